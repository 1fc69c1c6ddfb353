"""A decoder layer over the paged KV cache, built from its family's description.

A family (``families.py``) describes each of its layers with a ``LayerSpec``: which norms sit where
and how they scale, q/k norms, the activation, biases, the attention scale, a sliding window,
routed experts in place of the dense MLP (``moe.py``). The modules here build exactly those
parts and run them through the kernel backend; ``plan()`` hands the same description, with the
loaded weights, to the backend's one-call decode step (``KernelBackend.decode_step``). So a new
family takes both paths by describing itself (routed experts as a ``MoePlan``); a layer with
OLMoE's q/k norms over whole projections split across tensor-parallel ranks has no plan and
runs on the Python path.

Inputs are one flattened batch of T tokens (no padding, no batch dimension). q/k/v and
gate/up are merged into one matmul each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from actorlm.kernels import AttentionLayer, DecoderLayerPlan, KernelBackend, MoePlan
from actorlm.kernels.portable import ACTIVATION_FUNCTIONS, apply_rope, turn_qk
from actorlm.models.layers import (HeadLayerNorm, LayerNorm, Linear, RMSNorm, RowParallelLinear,
                                   SplitRMSNorm)
from actorlm.models.moe import MoeSpec, SparseMoeBlock
from actorlm.models.parallel import TensorParallel, num_kv_heads_per_rank


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer of a family, as its config says (whole model sizes, before a
    tensor-parallel split)."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    norm_unit_offset: bool = False  # norms scale by 1 + weight (kernels.Norm)
    # norms of q and k before RoPE: "head", each head's by one RMS norm (Qwen3, Gemma 3);
    # "head_layer", each head's LayerNorm by its own weights (Cohere's, StableLM 2 12B's, Phi's
    # qk_layernorm); "projection", over all heads at once (OLMoE); or after RoPE:
    # "head_after_rope", each head's by one RMS norm (Hunyuan's); None
    qk_norm: str | None = None
    qk_norm_bias: bool = False  # the "head_layer" norms have biases (Phi's)
    clip_qkv: float | None = None  # q, k and v clamped to +-clip_qkv after the norms (OLMoE)
    output_norms: bool = False  # norms on the attention's and the MLP's outputs too
    input_norms: bool = True  # norms on their inputs (OLMo 2 has none: only output norms)
    activation: str = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    attention_scale: float | None = None  # None: head_dim ** -0.5
    window: int | None = None  # sliding window; None: full causal attention
    softcap: float | None = None  # attention scores soft-capped (Gemma 2)
    # the attention's and the MLP's outputs scaled before they join the stream (Granite)
    residual_scale: float | None = None
    # each head's q and k features as the kernels rotate them (``rope_layout.head_order``);
    # None: the checkpoint's order
    rope_order: tuple[int, ...] | None = None
    moe: MoeSpec | None = None  # routed experts in place of the dense MLP
    # LayerNorm (the mean taken out; a bias with ``norm_bias``) in place of RMSNorm
    layer_norm: bool = False
    norm_bias: bool = False
    norm_weight: bool = True  # False: LayerNorms without a learned weight (OLMo's)
    parallel: bool = False  # attention and MLP both from the stream, summed
    parallel_mlp_norm: bool = False  # in parallel, the MLP through a norm of its own (GPT-NeoX)
    gated_mlp: bool = True  # act(gate) * up; False: act(up) alone (fc_in)
    # the checkpoint's fused q/k/v (and so a LoRA adapter's) in groups of a group's queries,
    # its key and its value (``families.qkv_groups``); 0: all q, all k, all v
    qkv_groups: int = 0
    # every token attends to its whole prompt, nothing cached (EmbeddingGemma's Gemma 3): a
    # sliding window then reaches ``window - 1`` positions either side, as transformers'
    # bidirectional window (whose config holds half the window, plus one)
    bidirectional: bool = False
    sinks: bool = False  # a learned logit per head in its softmax's denominator (GPT-OSS)

    def __post_init__(self):
        if self.qk_norm not in (None, "head", "head_layer", "projection", "head_after_rope"):
            raise ValueError(f"qk_norm must be None, 'head', 'head_layer', 'projection' or "
                             f"'head_after_rope', got {self.qk_norm!r}")


def _row_linear(in_features, out_features, bias, tp: TensorParallel, dtype, device) -> Linear:
    """A layer whose input features are split over the ranks (plain when there is one)."""
    if tp.is_parallel:
        return RowParallelLinear(in_features, out_features, bias, tp, dtype, device)
    return Linear(in_features, out_features, bias, dtype, device)


class Attention(nn.Module):
    """Tensor-parallel: this rank's query heads and the KV heads they read."""

    def __init__(self, spec: LayerSpec, backend: KernelBackend, dtype, device,
                 tp: TensorParallel):
        super().__init__()
        self.backend = backend
        self.num_heads = spec.num_heads // tp.size
        self.num_kv_heads = num_kv_heads_per_rank(spec.num_kv_heads, tp.size)
        self.head_dim = d = spec.head_dim
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, spec.qkv_bias,
                               dtype, device)
        self.o_proj = _row_linear(spec.num_heads * d, spec.hidden_size, spec.o_bias, tp, dtype,
                                  device)
        self.q_norm = self.k_norm = None
        self.projection_norms, self.clip_qkv = spec.qk_norm == "projection", spec.clip_qkv
        self.head_layer_norms = spec.qk_norm == "head_layer"
        self.norms_after_rope = spec.qk_norm == "head_after_rope"
        if spec.qk_norm in ("head", "head_after_rope"):
            self.q_norm, self.k_norm = (RMSNorm(d, spec.norm_eps, spec.norm_unit_offset,
                                                backend, dtype, device) for _ in range(2))
        elif self.projection_norms:  # this rank's heads of norms over all of them
            self.q_norm, self.k_norm = (SplitRMSNorm(size, spec.norm_eps, backend, dtype, device,
                                                     tp) for size in (self.q_size, self.kv_size))
        elif self.head_layer_norms:  # this rank's heads' own norms
            self.q_norm, self.k_norm = (HeadLayerNorm(heads, d, spec.norm_eps, spec.qk_norm_bias,
                                                      dtype, device)
                                        for heads in (self.num_heads, self.num_kv_heads))
        head_norms = (None, None) if self.q_norm is None or self.norms_here or \
            self.norms_after_rope else (self.q_norm.norm, self.k_norm.norm)
        scale = spec.attention_scale if spec.attention_scale is not None else d**-0.5
        # this rank's heads' sinks, kept in fp32 (the checkpoint's values, exactly)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, device=device), False) \
            if spec.sinks else None
        self.layer = AttentionLayer(self.num_heads, self.num_kv_heads, d, scale, spec.window,
                                    *head_norms, spec.softcap, self.sinks)
        # both ways (the door's window reaches either side; q/k norms and RoPE here)
        self.both_ways = None if not spec.bidirectional else AttentionLayer(
            self.num_heads, self.num_kv_heads, d, scale,
            None if spec.window is None else spec.window - 1)
        if spec.bidirectional and (spec.softcap is not None or self.norms_here
                                   or self.norms_after_rope or spec.sinks):
            raise ValueError("bidirectional attention with soft-capped scores, sinks or q/k "
                             "norms other than each head's RMS norm is not implemented")

    @property
    def norms_here(self) -> bool:
        """Whether q and k are normed here before the attention: over whole projections, or
        each head by its own LayerNorm (the backend norms the heads by one RMS norm)."""
        return self.projection_norms or self.head_layer_norms

    def forward(self, x, cos, sin_signed, kv_cache, meta):
        # x: [T, hidden]; cos, sin_signed: [T, 1, D]
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hkv) D]
        if self.norms_here:  # in place: the backend then norms no head
            q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size]
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        if self.norms_after_rope:  # turned here, then normed: the backend turns nothing more
            self._turned_and_normed(qkv, cos, sin_signed)
            cos, sin_signed = torch.ones_like(cos), torch.zeros_like(sin_signed)
        if self.both_ways is not None:  # q and k normed and turned here, nothing cached
            turn_qk(qkv, cos, sin_signed, self.layer)
            o = self.backend.bidirectional_attention(qkv, meta.query_start_loc.tolist(),
                                                     self.both_ways)
            return self.o_proj(o)
        o = self.backend.attention(qkv, cos, sin_signed, kv_cache, meta, self.layer)
        return self.o_proj(o)  # [T, Hq D] -> [T, hidden]


    def _turned_and_normed(self, qkv, cos, sin_signed) -> None:
        """q and k in ``qkv`` rotated by RoPE, then each head RMS-normed (Hunyuan's order,
        which the kernels' norm-then-rotate cannot express: a norm's weights do not commute
        with the rotation), in place."""
        rows = qkv.shape[0]
        for norm, start, size in ((self.q_norm, 0, self.q_size),
                                  (self.k_norm, self.q_size, self.kv_size)):
            part = qkv[:, start:start + size]
            heads = apply_rope(part.reshape(rows, -1, self.head_dim), cos, sin_signed)
            part.copy_(norm(heads.reshape(-1, self.head_dim)).view(rows, size))


def norm_of(spec: LayerSpec, backend: KernelBackend, dtype, device) -> RMSNorm | LayerNorm:
    """A norm over the hidden features, of the kind the family's layers have."""
    if spec.layer_norm:
        return LayerNorm(spec.hidden_size, spec.norm_eps, spec.norm_bias, dtype, device,
                         spec.norm_weight)
    return RMSNorm(spec.hidden_size, spec.norm_eps, spec.norm_unit_offset, backend, dtype,
                   device)


class MLP(nn.Module):
    """Tensor-parallel: this rank's share of the intermediate features; its output is summed
    over the ranks, unless ``reduce`` is False (a shared expert, whose MoE block reduces).
    Ungated (``gated_mlp`` False: StarCoder2's, Phi-2's): ``fc_in`` in place of gate_up."""

    def __init__(self, spec: LayerSpec, backend: KernelBackend, dtype, device,
                 tp: TensorParallel, reduce: bool = True):
        super().__init__()
        self.backend, self.activation = backend, spec.activation
        self.intermediate_size = spec.intermediate_size // tp.size
        self.gate_up_proj = self.fc_in = None
        if spec.gated_mlp:
            self.gate_up_proj = Linear(spec.hidden_size, 2 * self.intermediate_size,
                                       spec.mlp_bias, dtype, device)
        else:
            self.fc_in = Linear(spec.hidden_size, self.intermediate_size, spec.mlp_bias, dtype,
                                device)
        if reduce:
            self.down_proj = _row_linear(spec.intermediate_size, spec.hidden_size,
                                         spec.mlp_bias, tp, dtype, device)
        else:  # (a bias would be added once per rank)
            assert not spec.mlp_bias
            self.down_proj = Linear(self.intermediate_size, spec.hidden_size, False, dtype,
                                    device)

    def forward(self, x):
        if self.fc_in is not None:  # [T, H] -> [T, I] -> [T, H]
            return self.down_proj(ACTIVATION_FUNCTIONS[self.activation](self.fc_in(x)))
        # [T, H] -> [T, 2I] -> [T, I] -> [T, H]
        return self.down_proj(self.backend.act_and_mul(self.gate_up_proj(x), self.activation))


class DecoderLayer(nn.Module):
    """``kernels.DecoderLayerPlan``'s layer: norms before attention and MLP (and after each,
    with ``output_norms``; then ``residual_scale``), each residual add fused into the norm
    that follows it."""

    def __init__(self, spec: LayerSpec, backend, dtype, device, tp, rope: int = 0,
                 kv_group: int = 0):
        super().__init__()
        self.rope = rope  # which of the model's RoPE tables this layer rotates by
        self.kv_group = kv_group  # which of the step's attention metadata it reads
        self.residual_scale, self.parallel = spec.residual_scale, spec.parallel

        def norm():
            return norm_of(spec, backend, dtype, device)

        self.attn_norm = self.mlp_norm = self.attn_out_norm = self.mlp_out_norm = None
        if spec.input_norms:  # (in parallel, the MLP reads the attention's, or its own)
            own = not spec.parallel or spec.parallel_mlp_norm
            self.attn_norm, self.mlp_norm = norm(), norm() if own else None
        if spec.output_norms:
            self.attn_out_norm, self.mlp_out_norm = norm(), norm()
        self.self_attn = Attention(spec, backend, dtype, device, tp)
        if spec.moe is None:
            self.mlp = MLP(spec, backend, dtype, device, tp)
        else:
            shared = None if spec.moe.shared_intermediate_size is None else MLP(
                replace(spec, intermediate_size=spec.moe.shared_intermediate_size, moe=None),
                backend, dtype, device, tp, reduce=False)
            self.mlp = SparseMoeBlock(spec.moe, spec.hidden_size, spec.activation, backend,
                                      dtype, device, tp, shared)

    def forward(self, x, residual, ropes, kv_cache, metas):
        """(this layer's output, the residual stream before it); ``residual`` is None at the
        first layer, whose x is the embeddings. ``ropes`` and ``metas``: the step's RoPE
        tables and its attention metadata per KV-cache group."""
        x, residual = _joined(self.attn_norm, x, residual)
        if self.parallel:  # both branches of the stream, summed: the MLP through the
            # attention's norm (Phi-2, Cohere) or its own (GPT-NeoX)
            attended = self.self_attn(x, *ropes[self.rope], kv_cache, metas[self.kv_group])
            return attended + self.mlp(x if self.mlp_norm is None else self.mlp_norm(residual)), \
                residual
        x = self.self_attn(x, *ropes[self.rope], kv_cache, metas[self.kv_group])
        if self.attn_out_norm is not None:
            x = self.attn_out_norm(x)
        x, residual = _joined(self.mlp_norm, self._scaled(x), residual)
        x = self.mlp(x)
        if self.mlp_out_norm is not None:
            x = self.mlp_out_norm(x)
        return self._scaled(x), residual

    def _scaled(self, x):
        """A branch's output as it joins the stream."""
        return x if self.residual_scale is None else x * self.residual_scale

    def plan(self) -> DecoderLayerPlan | None:
        """This layer for the backend's one-call decode step (once the weights are loaded), or
        None where a plan does not describe it: q/k norms over projections split across
        tensor-parallel ranks (their mean square is summed over the ranks), each head's q/k
        LayerNorm by its own weights, q/k norms after RoPE, routing by scores (DeepSeek's,
        ERNIE's), attention both ways (which never decodes): the step has none of them."""
        attn, mlp = self.self_attn, self.mlp
        if attn.head_layer_norms or attn.norms_after_rope or attn.both_ways is not None or \
                isinstance(mlp, SparseMoeBlock) and mlp.routed_here:
            return None
        projection_norms = None
        if attn.projection_norms:
            if attn.q_norm.tp.is_parallel:
                return None
            projection_norms = (attn.q_norm.norm, attn.k_norm.norm)
        gated = True
        if isinstance(mlp, MLP):
            gated = mlp.fc_in is None
            dense, activation, moe = ((mlp.gate_up_proj or mlp.fc_in).prepared,
                                      mlp.down_proj.prepared), mlp.activation, None
        else:  # routed experts in the dense MLP's place
            dense, activation, moe = (None, None), mlp.experts.activation, _moe_plan(mlp)
        adapted = (attn.qkv_proj, attn.o_proj, *((mlp.gate_up_proj or mlp.fc_in, mlp.down_proj)
                                                 if isinstance(mlp, MLP) else (None, None)))
        lora = tuple(None if p is None or p.lora is None else p.lora.table for p in adapted)
        attn_norm, mlp_norm, attn_out_norm, mlp_out_norm = (
            None if n is None else n.norm
            for n in (self.attn_norm, self.mlp_norm, self.attn_out_norm, self.mlp_out_norm))
        return DecoderLayerPlan(
            attn_norm, attn.layer, attn.qkv_proj.prepared, attn.o_proj.prepared, mlp_norm,
            *dense, activation, attn_out_norm, mlp_out_norm,
            self.rope, self.kv_group, moe, projection_norms, attn.clip_qkv,
            self.residual_scale, None if lora == (None,) * 4 else lora, self.parallel, gated)


def _joined(norm: RMSNorm | LayerNorm | None, x, residual):
    """(a branch's input, the stream) once ``x`` has joined the stream ``residual`` (None: x
    starts it, the embeddings): the stream normed, or, without a norm (OLMo 2), the stream."""
    if norm is None:
        stream = x if residual is None else x + residual
        return stream, stream
    return (norm(x), x) if residual is None else norm(x, residual)


def _moe_plan(block: SparseMoeBlock) -> MoePlan:
    shared = block.shared_expert
    gate = block.shared_expert_gate
    parts = (None, None, None) if shared is None else (
        shared.gate_up_proj.prepared, shared.down_proj.prepared,
        None if gate is None else gate.prepared)
    return MoePlan(block.gate.prepared, block.experts.stacked, block.spec.top_k,
                   block.spec.renormalize, *parts)
