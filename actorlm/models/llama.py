"""The Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3) over the paged KV cache.

Inputs are one flattened batch of T tokens (no padding, no batch dimension); every attention
layer writes its new K/V into the paged cache and attends through the kernel backend, so the
same module runs the Triton kernels on a GPU and their torch twins on a CPU. q/k/v and
gate/up are merged into one matmul each; ``load_weights`` maps Hugging Face names onto them.

Attention is always full causal: a sliding window (Mistral v0.1, Qwen with
``use_sliding_window``) is not applied, which is exact while contexts fit in the window.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from actorlm.kernels import KernelBackend
from actorlm.kernels.cpu.decode_step import DecodeLayers
from actorlm.kernels.cpu.fused import add_rms_norm, rms_norm, silu_and_mul
from actorlm.models.layers import Linear, RowParallelLinear, VocabParallelEmbedding
from actorlm.models.metadata import AttentionMetadata
from actorlm.models.parallel import (TensorParallel, check_tensor_parallel, gather_last_dim,
                                     num_kv_heads_per_rank)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# HF checkpoint name fragment -> (merged parameter fragment, shard index)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps, dtype, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), False)

    def forward(self, x, residual=None):
        """``norm(x)``; with ``residual``: (norm(x + residual), x + residual), fused on a CPU
        (``kernels/cpu/fused.py``: x and residual may be written)."""
        if residual is not None:
            return add_rms_norm(x, residual, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(config, device=None) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] fp32, attention_scaling) through transformers' own RoPE init functions.

    transformers 5 keeps ``rope_theta`` and the scaling type in ``config.rope_parameters``;
    older versions have ``rope_theta`` and ``rope_scaling`` attributes.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("dynamic", "longrope"):
        # These switch frequencies with the running sequence length; not supported here.
        raise ValueError(f"rope type {rope_type!r} is not supported")
    if rope_type == "default" and "default" not in ROPE_INIT_FUNCTIONS:
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = _head_dim(config)
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim))
        return inv_freq, 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](config, device)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def apply_rope(x, cos, sin_signed):
    """x: [T, H, D]; cos, sin_signed: [T, 1, D]. HF's ``x * cos + rotate_half(x) * sin`` with
    the negation of rotate_half moved into the table (``sin_signed`` is sin with its first half
    negated): the same bits in four ops instead of seven."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


def _row_linear(in_features, out_features, bias, tp: TensorParallel, dtype, device) -> Linear:
    """A layer whose input features are split over the ranks (plain when there is one)."""
    if tp.is_parallel:
        return RowParallelLinear(in_features, out_features, bias, tp, dtype, device)
    return Linear(in_features, out_features, bias, dtype, device)


class Attention(nn.Module):
    """Tensor-parallel: this rank's query heads and the KV heads they read."""

    def __init__(self, config, backend: KernelBackend, dtype, device, tp: TensorParallel):
        super().__init__()
        self.backend = backend
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads = num_kv_heads_per_rank(
            getattr(config, "num_key_value_heads", None) or config.num_attention_heads, tp.size)
        self.head_dim = _head_dim(config)
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        is_qwen2 = config.model_type == "qwen2"
        # Qwen2 always has a qkv bias (and none on o_proj); the others follow attention_bias.
        qkv_bias = is_qwen2 or bool(getattr(config, "attention_bias", False))
        o_bias = not is_qwen2 and bool(getattr(config, "attention_bias", False))
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(hidden, self.q_size + 2 * self.kv_size, qkv_bias, dtype, device)
        self.o_proj = _row_linear(self.q_size * tp.size, hidden, o_bias, tp, dtype, device)
        self.q_norm = self.k_norm = None
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype, device)

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata):
        # x: [T, hidden]; cos, sin: [T, 1, D] (sin with its first half negated, see apply_rope)
        num_tokens, d = x.shape[0], self.head_dim
        qkv = self.qkv_proj(x)  # [T, Hq*D + 2*Hkv*D]
        k_cache, v_cache = kv_cache
        if self.q_norm is None and self.backend.rope_attention is not None:
            o = self.backend.rope_attention(qkv, cos, sin, k_cache, v_cache, meta, self.scale,
                                            self.num_heads, self.num_kv_heads)
            if o is not None:
                return self.o_proj(o.reshape(num_tokens, self.q_size))
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, self.num_kv_heads, d)
        if self.q_norm is None:  # q and k rotate as one tensor: [T, Hq + Hkv, D]
            qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, -1, d)
            qk = apply_rope(qk, cos, sin)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        else:
            q = self.q_norm(qkv[:, :self.q_size].view(num_tokens, self.num_heads, d))
            k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size]
                            .view(num_tokens, self.num_kv_heads, d))
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = self.backend.attention(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """Tensor-parallel: this rank's share of the intermediate features."""

    def __init__(self, config, dtype, device, tp: TensorParallel):
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size // tp.size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, bias, dtype, device)
        self.down_proj = _row_linear(config.intermediate_size, config.hidden_size, bias, tp,
                                     dtype, device)

    def forward(self, x):
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, H]


class DecoderLayer(nn.Module):
    def __init__(self, config, backend, dtype, device, tp):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.self_attn = Attention(config, backend, dtype, device, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.mlp = MLP(config, dtype, device, tp)

    def forward(self, x, residual, cos, sin, kv_cache, meta):
        """(this layer's output, the residual stream before it): HF's ``x + attn(norm(x))``
        and ``x + mlp(norm(x))``, with each add fused into the norm that follows it."""
        if residual is None:  # the first layer
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaBody(nn.Module):
    """Named ``model`` inside LlamaForCausalLM so parameter names match HF checkpoints."""

    def __init__(self, config, backend, dtype, device, tp):
        super().__init__()
        if tp.is_parallel:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp,
                                                       dtype, device)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype,
                                             device=device)
            self.embed_tokens.weight.requires_grad_(False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, backend, dtype, device, tp) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)


class LlamaForCausalLM(nn.Module):
    """With ``tp`` of size N > 1, rank ``tp.rank``'s shard: 1/N of the query heads, of the KV
    heads (or one replicated), of the MLP and of the vocabulary (padded up to a multiple of N),
    loaded straight from the checkpoint's tensors (``load_weights``)."""

    def __init__(self, config, backend: KernelBackend, dtype: torch.dtype = torch.float32,
                 device=None, tp: TensorParallel = TensorParallel()):
        super().__init__()
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {config.model_type!r} is not supported (use one of {SUPPORTED_MODEL_TYPES})")
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        check_tensor_parallel(config.model_type, config.num_attention_heads, num_kv_heads,
                              config.intermediate_size, tp.size)
        self.config = config
        self.dtype = dtype
        self.tp = tp
        self.num_layers = config.num_hidden_layers
        self.head_dim = _head_dim(config)
        self.vocab_size = config.vocab_size
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = LlamaBody(config, backend, dtype, device, tp)
        attn = self.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads  # this rank's
        vocab_rows = -(-config.vocab_size // tp.size)  # this rank's slice, padded
        self.lm_head = Linear(config.hidden_size, vocab_rows, False, dtype, device)
        if tp.is_parallel:  # its padding rows past the vocabulary are never loaded
            self.lm_head.weight.data.zero_()
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # cos and sin of every position, computed once as HF computes them per step (fp32
        # angles, then the model dtype): [max_positions, D] each, sin's first half negated
        inv_freq, scaling = rope_inv_freq(config, device)
        max_positions = getattr(config, "max_position_embeddings", None) or 2048
        freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        half = emb.shape[-1] // 2
        sign = torch.cat((-torch.ones(half, device=device), torch.ones(half, device=device)))
        self.register_buffer("rope_cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("rope_sin", (emb.sin() * scaling).to(dtype) * sign.to(dtype),
                             persistent=False)
        self.decode_layers: DecodeLayers | None = None  # set once the weights are packed

    def rope(self, positions):
        """cos, sin_signed: [T, 1, D] for ``apply_rope``."""
        return self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_caches: per layer (k_cache, v_cache) -> [T, hidden]."""
        cos, sin = self.rope(positions)
        x, residual = self.model.embed_tokens(input_ids), None  # [T, hidden]
        fused = None if self.decode_layers is None else \
            self.decode_layers(x, cos, sin, kv_caches, meta)
        if fused is not None:  # a decode step on a CPU: every layer in one C++ call
            x, residual = fused
        else:
            for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [N, hidden] -> logits [N, V] float32. Tensor-parallel: every rank must call
        it (a collective); rank 0 gets the logits, the others None."""
        if not self.tp.is_parallel:
            return self.lm_head(hidden).float()
        logits = gather_last_dim(self.tp, self.lm_head(hidden))  # [N, V_pad] on rank 0
        if logits is None:
            return None
        return logits[:, :self.vocab_size].float().contiguous()  # without the padding

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy HF-named tensors into the (merged) parameters, raising if any is left unset, then
        pack the linear layers where the device gains by it (the packed copies replace the plain
        weights). Tensor-parallel: only this rank's part of each tensor is taken; a safetensors
        slice (``safe_open(...).get_slice``) in place of a tensor then reads only that part from
        the file."""
        params = dict(self.named_parameters())  # a tied lm_head appears once, as embed_tokens
        missing = {key for name in params for key in _load_keys(name)}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue  # recomputed at init / shared with embed_tokens
            target, shard = name, None
            for fragment, (merged, index) in _STACKED.items():
                if fragment in name:
                    target, shard = name.replace(fragment, merged), index
                    break
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            dst = params[target]
            if shard is not None:
                start, size = self._shard_range(target, shard)
                dst = dst.narrow(0, start, size)
            if self.tp.is_parallel:
                tensor = self._rank_part(name, tensor)
                if target == "model.embed_tokens.weight" or target == "lm_head.weight":
                    dst = dst.narrow(0, 0, tensor.shape[0])  # the last slice may be short
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(tensor.to(dtype=dst.dtype, device=dst.device))
            missing.discard(target if shard is None else f"{target}#{shard}")
        if missing:
            raise ValueError(f"checkpoint is missing weights: {sorted(missing)}")
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
                module.drop_plain_weight()  # a tied LM head's is the embedding's: it stays
        self.decode_layers = DecodeLayers.build(self)

    def _shard_range(self, merged_name, shard) -> tuple[int, int]:
        """(first row, rows) of shard ``shard`` inside a merged weight or bias."""
        if ".qkv_proj." in merged_name:
            attn = self.model.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.model.layers[0].mlp.intermediate_size] * 2
        return sum(sizes[:shard]), sizes[shard]

    def _rank_part(self, name, tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor ``name``: rows of the column-parallel
        layers, columns of the row-parallel ones, the whole of the replicated ones."""
        attn, mlp, rank = self.model.layers[0].self_attn, self.model.layers[0].mlp, self.tp.rank
        dim, start, length = 0, 0, None  # None: all of it
        if ".q_proj." in name:
            start, length = rank * attn.q_size, attn.q_size
        elif ".k_proj." in name or ".v_proj." in name:
            # the KV heads this rank's query heads read (a replicated head: the same on several)
            num_kv_heads = getattr(self.config, "num_key_value_heads", None) or \
                self.config.num_attention_heads
            first = rank * attn.num_heads * num_kv_heads // self.config.num_attention_heads
            start, length = first * self.head_dim, attn.kv_size
        elif ".gate_proj." in name or ".up_proj." in name:
            start, length = rank * mlp.intermediate_size, mlp.intermediate_size
        elif ".o_proj.weight" in name:
            dim, start, length = 1, rank * attn.q_size, attn.q_size
        elif ".down_proj.weight" in name:
            dim, start, length = 1, rank * mlp.intermediate_size, mlp.intermediate_size
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = self.lm_head.weight.shape[0]
            start = rank * rows
            length = max(0, min(rows, self.vocab_size - start))
        return _narrow(tensor, dim, start, length)


def _narrow(tensor, dim, start, length) -> torch.Tensor:
    """``start:start + length`` along ``dim`` (everything when ``length`` is None) of a tensor,
    or read from a safetensors slice."""
    if isinstance(tensor, torch.Tensor):
        return tensor if length is None else tensor.narrow(dim, start, length)
    if length is None:
        return tensor[:]
    return tensor[(slice(None),) * dim + (slice(start, start + length),)]


def _load_keys(param_name) -> list[str]:
    """What must be loaded to fill ``param_name``: one key per checkpoint tensor merged into it."""
    if ".qkv_proj." in param_name:
        return [f"{param_name}#{i}" for i in range(3)]
    if ".gate_up_proj." in param_name:
        return [f"{param_name}#{i}" for i in range(2)]
    return [param_name]
