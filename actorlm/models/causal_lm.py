"""The model of every decoder family (``families.py`` says how each differs): the
embedding, the RoPE tables, the shared decoder layers of ``decoder.py`` over the paged KV
cache (dense MLPs or routed experts), the final norm and the LM head, loaded straight from a
checkpoint's tensors.

Each layer reads its KV blocks through its KV-cache group's metadata (``actorlm.kv_groups``):
a sliding-window layer's group holds only the blocks its window still reads.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from torch import nn

from actorlm.kernels import ActivationQuant, AttentionMetadata, KernelBackend, QuantizedWeight
from actorlm.kv_groups import kv_cache_groups, layer_slots
from actorlm.models import expert_weights, quantized
from actorlm.models.decoder import DecoderLayer, norm_of
from actorlm.models.encoder import attends_both_ways, cache_windows
from actorlm.models.checkpoint_names import checkpoint_tensors, narrow
from actorlm.models.families import (NO_ROPE, embedding_scale, head_dim_of, is_gemma,
                                     layer_specs, lm_head_bias, logits_divisor,
                                     long_rope_from, norm_names, num_kv_heads_of,
                                     position_offset, rope_inv_freq, rope_layer_types)
from actorlm.models.layers import Embedding, Linear, VocabParallelEmbedding
from actorlm.models.expert_parallel import check_expert_parallel, split_intermediate_sizes
from actorlm.models.moe import MoeTimer, RoutedExperts, SparseMoeBlock
from actorlm.models.parallel import (TensorParallel, check_tensor_parallel, first_kv_head,
                                     gather_last_dim)

# HF checkpoint name fragment -> (merged parameter fragment, shard index)
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class DecoderBody(nn.Module):
    """Named ``model`` inside CausalLM so parameter names match HF checkpoints."""

    def __init__(self, config, specs, ropes, groups, backend, dtype, device, tp):
        super().__init__()
        if tp.is_parallel:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp,
                                                       dtype, device)
        else:
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype, device)
        # learned position embeddings (OPT's), whole on every rank; None: RoPE's positions
        self.position_offset = position_offset(config)
        self.embed_positions = None if self.position_offset is None else Embedding(
            config.max_position_embeddings + self.position_offset, config.hidden_size, dtype,
            device)
        self.layers = nn.ModuleList(DecoderLayer(spec, backend, dtype, device, tp, rope, group)
                                    for spec, rope, group in zip(specs, ropes, groups))
        self.norm = norm_of(specs[0], backend, dtype, device)


class CausalLM(nn.Module):
    """With ``tp`` of size N > 1, rank ``tp.rank``'s shard: 1/N of the query heads, of the KV
    heads (or one replicated), of the MLP, of each routed expert (with ``tp.expert_parallel``:
    1/N of the experts, whole) and of the vocabulary (padded up to a multiple of N), loaded
    straight from the checkpoint's tensors (``load_weights``). With ``pooling`` (a pooling
    model's task, ``actorlm.pooling``) it has no LM head, and its checkpoint may be a bare
    decoder's (``Qwen3Model``: ``layers.0...`` for ``model.layers.0...``); a classifier's
    (``classify``) has its score head instead, whole on every rank."""

    def __init__(self, config, backend: KernelBackend, dtype: torch.dtype = torch.float32,
                 device=None, tp: TensorParallel = TensorParallel(),
                 pooling: str | None = None):
        super().__init__()
        specs = layer_specs(config)  # refuses what the config asks for and is not implemented
        spec = specs[0]
        check_expert_parallel(config.model_type, config, tp.size, tp.expert_parallel)
        check_tensor_parallel(config.model_type, spec.num_heads, spec.num_kv_heads,
                              split_intermediate_sizes(config, tp.expert_parallel), tp.size)
        both_ways = attends_both_ways(config)  # (EmbeddingGemma: no cache, no bytes)
        if both_ways and not pooling:
            raise ValueError(f"{config.model_type} with use_bidirectional_attention embeds "
                             f"(--runner pooling); generating text is not implemented")
        self.kv_cache_groups = kv_cache_groups(cache_windows(config))
        rope_types = rope_layer_types(config)
        table_types = sorted(set(rope_types), key=str)  # one RoPE table per distinct type
        self.config, self.backend, self.dtype, self.tp = config, backend, dtype, tp
        self.device = device
        self.num_layers = config.num_hidden_layers
        self.head_dim = spec.head_dim
        self.vocab_size = config.vocab_size
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.norms = norm_names(config)  # checkpoint -> ours
        self.embed_scale = embedding_scale(config, dtype, device)
        self.logits_divisor = logits_divisor(config)
        self.final_softcap = getattr(config, "final_logit_softcapping", None) \
            if is_gemma(config) else None
        self.model = DecoderBody(config, specs, [table_types.index(t) for t in rope_types],
                               layer_slots(self.kv_cache_groups)[0], backend, dtype, device, tp)
        attn = self.model.layers[0].self_attn
        self.num_heads = attn.num_heads  # this rank's
        self.num_kv_heads = 0 if both_ways else attn.num_kv_heads
        self.vocab_rows = -(-config.vocab_size // tp.size)  # this rank's slice, padded
        self.lm_head = None if pooling else \
            Linear(config.hidden_size, self.vocab_rows, lm_head_bias(config), dtype, device)
        if tp.is_parallel and not pooling:  # its padding rows past the vocabulary: never loaded
            for param in self.lm_head.parameters():
                param.data.zero_()
        if self.tie_word_embeddings and not pooling:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.score = Linear(config.hidden_size, config.num_labels, False, dtype, device) \
            if pooling == "classify" else None
        max_positions = getattr(config, "max_position_embeddings", None) or 2048
        # LongRoPE: each table's rows are the short factors' first positions, then the long
        # factors' all (``rope_rows``)
        self.long_rope_from = long_rope_from(config)
        self.rope_tables = [rope_table(config, t, max_positions, self.long_rope_from, dtype,
                                        device) for t in table_types]
        self.decode_step = None  # the backend's one-call decode step, once the weights load
        self.lora_state = None  # LoRA adapters' step mapping, once enabled (``lora_slots``)
        self.moe_timer = _moe_timer(self.model, device)

    def rope_rows(self, start: int, end: int, num_prompt_tokens: int) -> Sequence[int]:
        """The RoPE tables' rows of a request's positions ``start:end``: the positions
        themselves, but in a LongRoPE model whose request reaches past the original context
        (its prompt does, or a position does: transformers' rule for one sequence), the long
        factors' rows after the short ones'."""
        short = self.long_rope_from
        if short is None or (end <= short and num_prompt_tokens <= short):
            return range(start, end)
        if num_prompt_tokens > short or start >= short:
            return range(start + short, end + short)
        return [*range(start, short), *range(2 * short, end + short)]

    def ropes(self, rows) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The step's RoPE tables, (cos, sin_signed) [T, 1, D] each (Gemma 3: two)."""
        return [(cos[rows][:, None], sin[rows][:, None]) for cos, sin in self.rope_tables]

    def forward(self, input_ids, positions, kv_caches,
                metas: Sequence[AttentionMetadata]) -> torch.Tensor:
        """input_ids, positions: [T] int64, positions as rows of the RoPE tables (``rope_rows``);
        kv_caches: per layer (k_cache, v_cache); metas: the step's attention metadata, one per
        KV-cache group (``kv_groups``) -> [T, hidden]."""
        ropes = self.ropes(positions)
        if self.moe_timer is not None:
            self.moe_timer.reset()  # it holds the last forward's seconds
        x, residual = self.model.embed_tokens(input_ids), None  # [T, hidden]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        if self.model.embed_positions is not None:  # (no RoPE: rows are positions)
            x = x + self.model.embed_positions(positions + self.model.position_offset)
        # (the step's LoRA slots, each row's, where it has adapters: the one call takes them)
        lora_slots = None if self.lora_state is None else self.lora_state.mapping.token_slots
        fused = None if self.decode_step is None else \
            self.decode_step(x, ropes, kv_caches, metas, lora_slots)
        if fused is not None:  # every layer in one call (a decode step on a CPU)
            x, residual = fused
            # (the step timed its MoE layers itself, where it says so: KernelBackend.decode_step)
            seconds = getattr(self.decode_step, "moe_seconds", None)
            if self.moe_timer is not None and seconds is not None:
                self.moe_timer.add(*seconds)
        else:
            for layer, kv_cache in zip(self.model.layers, kv_caches, strict=True):
                x, residual = layer(x, residual, ropes, kv_cache, metas)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden: [N, hidden] -> logits [N, V] float32. Tensor-parallel: every rank must call
        it (a collective); rank 0 gets the logits, the others None."""
        if not self.tp.is_parallel:
            return self._finished(self.lm_head(hidden).float())
        logits = gather_last_dim(self.tp, self.lm_head(hidden))  # [N, V_pad] on rank 0
        if logits is None:
            return None
        return self._finished(logits[:, :self.vocab_size].float().contiguous())  # unpadded

    def _finished(self, logits: torch.Tensor) -> torch.Tensor:
        """The LM head's logits as the family ends them: divided (Granite), soft-capped
        (Gemma 2)."""
        if self.logits_divisor is not None:
            logits = logits / self.logits_divisor
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Copy HF-named tensors into the (merged) parameters, raising if any is left unset, then
        ``prepare_kernels``. A ``QuantizedWeight`` is kept in its blocks by the layer it
        belongs to. Tensor-parallel: only this rank's part of each tensor is taken; a
        safetensors slice (``safe_open(...).get_slice``) in place of a tensor then reads only
        that part from the file."""
        params = dict(self.named_parameters())  # a tied lm_head appears once, as embed_tokens
        missing = {key for name, param in params.items()
                   for key in _load_keys(name, param, self.tp)}
        if self.lm_head is None:
            weights = _decoder_only(weights)
        for name, tensor in checkpoint_tensors(self.config, weights):
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue  # recomputed at init / shared with embed_tokens
            experts = expert_weights.expert_parts(name, tensor, params, self.tp)
            for keys, dst, part, slot in experts or ():  # routed experts: their stacked rows
                if isinstance(part, QuantizedWeight):  # kept in blocks, one expert's rows
                    _check_shape(name, dst, part)
                    module, *where = slot
                    self.get_submodule(module).load_quantized(*where, part)
                else:
                    _copy(name, dst, part)
                missing.difference_update(keys)
            if experts is not None:
                continue
            target, shard = _renamed(name, self.norms), None
            for fragment, (merged, index) in _STACKED.items():
                if fragment in target:
                    target, shard = target.replace(fragment, merged), index
                    break
            if isinstance(tensor, ActivationQuant):  # an FP8 checkpoint's, for a layer's input
                self._quantize_inputs(name, target.removesuffix(".input_quant"), tensor)
                continue
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            dst, first_row = params[target], 0
            if shard is not None:
                first_row, size = self._shard_range(target, shard, dst)
                dst = dst.narrow(0, first_row, size)
            vocabulary = target in _VOCABULARY
            if self.tp.is_parallel:
                tensor = self._rank_part(name, tensor, dst)
                if vocabulary:
                    if isinstance(tensor, QuantizedWeight):  # zero rows: the padding
                        tensor = quantized.pad_rows(tensor, dst.shape[0])
                    else:
                        dst = dst.narrow(0, 0, tensor.shape[0])  # the last slice may be short
            if isinstance(tensor, QuantizedWeight):
                _check_shape(name, dst, tensor)
                self.get_submodule(target.removesuffix(".weight")).load_quantized(first_row,
                                                                                  tensor)
            else:
                _copy(name, dst, tensor)
            missing.discard(target if shard is None else f"{target}#{shard}")
        if missing:
            raise ValueError(f"checkpoint is missing weights: "
                             f"{sorted(_hf_name(key, self.norms) for key in missing)}")
        self.prepare_kernels()

    def _quantize_inputs(self, name: str, module: str, quant: ActivationQuant) -> None:
        try:
            layer = self.get_submodule(module)
        except AttributeError:
            layer = None
        if not isinstance(layer, Linear) or ".experts." in module:
            raise ValueError(f"{name}: FP8 activations of {module} are not implemented (the "
                             f"attention's and dense MLPs' linear layers', not routed "
                             f"experts')")
        layer.quantize_inputs(quant)

    def prepare_kernels(self) -> None:
        """Once every weight is in place: hand the linear layers to the backend and ask it for
        a one-call decode step over the layers' plans."""
        embedding = self.model.embed_tokens
        tied = self.tie_word_embeddings and embedding.quantized is not None and \
            self.lm_head is not None
        if tied:  # the same blocks, held once
            embedding.prepare_tied(self.backend, self.lm_head)
        for module in self.modules():
            if isinstance(module, (Linear, Embedding, RoutedExperts)) and \
                    not (tied and module is self.lm_head):
                module.prepare(self.backend)
        self.build_decode_step()

    def build_decode_step(self) -> None:
        """The backend's one-call decode step over the layers' plans (again once LoRA slots
        join them: ``lora_slots``)."""
        plans = [layer.plan() for layer in self.model.layers]
        # (a step of parallel layers needs their collectives; a layer without a plan, such as
        # one of routed experts, runs only on the Python path, and so do the others with it)
        if not self.tp.is_parallel and None not in plans:
            self.decode_step = self.backend.decode_step(plans, self.dtype)

    def _shard_range(self, merged_name, shard, merged) -> tuple[int, int]:
        """(first row, rows) of shard ``shard`` inside a merged weight or bias ``merged``."""
        if ".qkv_proj." in merged_name:
            attn = self.model.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:  # gate and up, halves of this rank's rows (a dense MLP's, a shared expert's)
            sizes = [merged.shape[0] // 2] * 2
        return sum(sizes[:shard]), sizes[shard]

    def _rank_part(self, name, tensor, dst) -> torch.Tensor:
        """This rank's part of the checkpoint tensor ``name`` that fills ``dst``: rows of the
        column-parallel layers, columns of the row-parallel ones, the whole of the replicated
        ones."""
        attn, rank = self.model.layers[0].self_attn, self.tp.rank
        dim, start, length = 0, 0, None  # None: all of it
        if attn.norms_here and name.endswith((".q_norm.weight", ".k_norm.weight",
                                              ".q_norm.bias", ".k_norm.bias")):
            # OLMoE's norms over the whole q and k, each head's own LayerNorms (Cohere's):
            # this rank's heads of them, as q_proj's and k_proj's rows
            name = name.replace("_norm.", "_proj.")
        if ".q_proj." in name:
            start, length = rank * attn.q_size, attn.q_size
        elif ".k_proj." in name or ".v_proj." in name:
            # the KV heads this rank's query heads read (a replicated head: the same on several)
            first = first_kv_head(self.tp, self.config.num_attention_heads,
                                  num_kv_heads_of(self.config))
            start, length = first * self.head_dim, attn.kv_size
        elif ".gate_proj." in name or ".up_proj." in name or ".fc_in." in name:
            # this rank's half of gate_up, its share of an ungated MLP's fc_in
            start, length = rank * dst.shape[0], dst.shape[0]
        elif name.endswith(".self_attn.sinks"):  # this rank's heads'
            start, length = rank * attn.num_heads, attn.num_heads
        elif ".o_proj.weight" in name:
            dim, start, length = 1, rank * attn.q_size, attn.q_size
        elif ".down_proj.weight" in name:
            dim, start, length = 1, rank * dst.shape[1], dst.shape[1]
        elif name in _VOCABULARY:
            rows = self.vocab_rows
            start = rank * rows
            length = max(0, min(rows, self.vocab_size - start))
        return narrow(tensor, dim, start, length)


_BARE_DECODER = ("embed_tokens.", "layers.", "norm.")  # a ``...Model`` checkpoint's names
# the tensors split by the vocabulary over the ranks (Phi-2's LM head has a bias)
_VOCABULARY = ("model.embed_tokens.weight", "lm_head.weight", "lm_head.bias")


def _decoder_only(weights):
    """A pooling model's tensors: an LM head's left out, a bare decoder's names as a causal
    LM's (``model.`` before them)."""
    for name, tensor in weights:
        if not name.startswith("lm_head."):
            yield ("model." + name if name.startswith(_BARE_DECODER) else name), tensor


def _moe_timer(body: DecoderBody, device) -> MoeTimer | None:
    """One timer for the mixture-of-experts layers of a model on a CPU (``MoeTimer`` says why
    not on a GPU), handed to each of them; None for a model without such layers."""
    blocks = [layer.mlp for layer in body.layers if isinstance(layer.mlp, SparseMoeBlock)]
    if not blocks or torch.device(device or "cpu").type != "cpu":
        return None
    timer = MoeTimer()
    for block in blocks:
        block.timer = timer
    return timer


def rope_table(config, layer_type, max_positions, long_rope_from, dtype, device):
    """(cos, sin_signed) of every position, computed once as HF computes them per step (fp32
    angles, then the model dtype): [max_positions, D] each, sin's first half negated. LongRoPE
    (``long_rope_from``: its original context): the short factors' rows of the positions
    within it, then the long factors' of every position."""
    if long_rope_from is None:
        return _rope_rows(config, layer_type, max_positions, False, dtype, device)
    short, long = (_rope_rows(config, layer_type, n, is_long, dtype, device)
                   for n, is_long in ((long_rope_from, False), (max_positions, True)))
    return torch.cat((short[0], long[0])), torch.cat((short[1], long[1]))


def _rope_rows(config, layer_type, num_positions, long, dtype, device):
    # (a layer without RoPE has no frequencies: all of its table is what they get below)
    inv_freq, scaling = (torch.zeros(0, device=device), 1.0) if layer_type == NO_ROPE else \
        rope_inv_freq(config, layer_type, device, long)
    half = head_dim_of(config) // 2
    # the features RoPE leaves (partial rotary: rope_layout) turn by frequency 0, unscaled:
    # cos 1 and sin 0, which leave them exactly as they are
    rotated = torch.arange(half, device=device) < len(inv_freq)
    inv_freq = torch.cat((inv_freq.float(), inv_freq.new_zeros(half - len(inv_freq))))
    freqs = torch.arange(num_positions, device=device).float()[:, None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = torch.where(rotated, scaling, 1.0).repeat(2)
    sign = torch.cat((-torch.ones(half, device=device), torch.ones(half, device=device)))
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype) * sign.to(dtype)


def _renamed(name: str, norms: dict[str, str]) -> str:
    for fragment, ours in norms.items():
        name = name.replace(fragment, ours)
    return name


def _hf_name(key: str, norms: dict[str, str]) -> str:
    """A parameter's (or merged shard's) name as the checkpoint spells it."""
    for fragment, ours in norms.items():
        key = key.replace(ours, fragment)
    return key


def _check_shape(name, dst, tensor) -> None:
    if dst.shape != tensor.shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")


def _copy(name, dst, tensor) -> None:
    _check_shape(name, dst, tensor)
    with torch.no_grad():
        dst.copy_(tensor.to(dtype=dst.dtype, device=dst.device))


def _load_keys(param_name, param, tp: TensorParallel) -> list[str]:
    """What must be loaded to fill ``param_name``: one key per checkpoint tensor merged into it."""
    if expert_weights.is_experts_param(param_name):
        return expert_weights.expert_keys(param_name, expert_weights.held_experts(param, tp))
    if (keys := expert_weights.bias_keys(param_name)) is not None:
        return keys
    if ".qkv_proj." in param_name:
        return [f"{param_name}#{i}" for i in range(3)]
    if ".gate_up_proj." in param_name:
        return [f"{param_name}#{i}" for i in range(2)]
    return [param_name]
