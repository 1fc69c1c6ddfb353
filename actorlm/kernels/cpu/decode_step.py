"""A decode step through every decoder layer in one C++ call (``csrc/decode_step.cpp``).

The C++ side executes the layers' descriptions (``kernels.backend.DecoderLayerPlan``), which
the model family gives: the kernels the Python layers call, in the same order with the same
bits; only the Python between them goes. A decode step streams the weights through the caches,
evicting the interpreter's working set, so each Python-level op after a GEMV costs tens of
microseconds of cache misses: ten per layer were a fifth of a one-request SmolLM2 step.

It takes layers whose every piece has its C++ kernel here (linear layers on the panel GEMM,
which needs AVX-512 or, for fp32 up to 16 rows, AVX2 and FMA, and for bf16 avx512_bf16, or in
GGML blocks on the quantized one; RoPE and
decode attention for their head shape, with or without a sliding window and a score cap (not
with attention sinks: GPT-OSS's layers run in Python); routed
experts packed for the panel GEMM, ``experts.py``, all of the router's or a share of them, with
their router and shared expert), and a step whose every request decodes one token, in request
order (in bf16, one or two requests: beyond, oneDNN's AMX GEMM runs the linear layers); for
anything else ``DecodeStep`` answers None and the Python layers run.

Rows whose request runs a LoRA adapter get its deltas on each adapted projection inside the
call (``csrc/lora.cpp``, from the layers' ``lora`` tables and the step's ``lora_slots``), the
kernel the CPU backend's ``add_lora`` runs for the Python layers too.

Layers of different KV-cache groups (``kv_groups``: full-attention layers and sliding ones) read
their blocks through their own group's block table and write their new K/V at its slots: the
step hands the C++ side one (slots, block table) pair per group, and each layer its index.
"""

from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from actorlm.kernels.backend import (ACTIVATIONS, ActivationQuant, DecoderLayerPlan, MoePlan,
                                     Norm)
from actorlm.kernels.cpu import abi, decode_attention, fused, lora, native
from actorlm.kernels.cpu.attention import AttentionPlan
from actorlm.kernels.cpu.experts import PanelExperts
from actorlm.kernels.cpu.linear import PanelLinear
from actorlm.kernels.cpu.quant import QuantLinear
from actorlm.kernels.metadata import AttentionMetadata
from actorlm.kernels.portable import QuantizedInputs

_NormStruct = abi.STRUCT_TYPES["actorlm_norm"]
_LinearStruct = abi.STRUCT_TYPES["actorlm_linear"]
_LayerStruct = abi.STRUCT_TYPES["actorlm_decoder_layer"]
_MoeStruct = abi.STRUCT_TYPES["actorlm_moe"]
_GroupStruct = abi.STRUCT_TYPES["actorlm_kv_group"]
_StepStruct = abi.STRUCT_TYPES["actorlm_decode_step"]
_MoeSecondsStruct = abi.STRUCT_TYPES["actorlm_moe_seconds"]
_LoRAStruct = lora.LoRAStruct


class DecodeStep:
    """``layers`` as one call for pure decode steps; ``build`` says whether the layers qualify,
    ``__call__`` whether the step does. ``num_steps`` counts the steps it ran, ``moe_seconds``
    says where the last one's time went in the mixture-of-experts layers."""

    def __init__(self, layers: Sequence[DecoderLayerPlan], dtype: torch.dtype, function,
                 max_rows: int | None, roundings: Sequence[tuple] | None = None):
        self.layers, self.dtype, self.function = list(layers), dtype, function
        # per layer, the FP8 rounding of qkv's, o's, gate_up's and down's inputs (or None each)
        self.roundings = list(roundings or [(None,) * 4] * len(self.layers))
        self.max_rows = max_rows
        self.num_groups = max(layer.kv_group for layer in self.layers) + 1  # metas it reads
        self._groups_type = _GroupStruct * self.num_groups
        self.num_steps = 0
        self._structs, self._caches = None, None  # the layers' structs, for these KV caches
        self._kv_type = 0  # what the caches hold (``abi``'s kv_type of the step)
        # the layers' experts' structs, which the layers' structs point to
        self._moes = [None if layer.moe is None else _moe_struct(layer.moe)
                      for layer in self.layers]
        self._seconds = _MoeSecondsStruct()  # the C++ step adds to it: zeroed before each
        self._seconds_pointer = ctypes.pointer(self._seconds)
        # the layers' LoRA structs, if any has slots (they point into the plans' tables)
        self._loras = [_lora_structs(layer.lora) for layer in self.layers]
        self.has_lora = any(layer.lora is not None for layer in self.layers)

    @classmethod
    def build(cls, layers: Sequence[DecoderLayerPlan], dtype: torch.dtype) -> DecodeStep | None:
        suffix = native.dtype_suffix(dtype)
        function = None if suffix is None else native.function(f"actorlm_decode_layers_{suffix}")
        layers, roundings = zip(*map(_without_fp8_inputs, layers)) if layers else ((), ())
        if function is None or not layers or not all(_runs_here(layer, dtype) for layer in layers):
            return None
        limits = [linear.max_rows for layer in layers for linear in _linears(layer)
                  if linear.max_rows is not None]
        return cls(layers, dtype, function, min(limits, default=None), roundings)

    def __call__(self, x: torch.Tensor, ropes: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 kv_caches, metas: Sequence[AttentionMetadata],
                 lora_slots: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last layer's output, the residual stream before it) for the embeddings x
        [T, hidden], as the Python layers compute them, bit for bit (their LoRA deltas on the
        CPU backend's kernel, ``lora.add_lora``, too); ``metas``: the step's attention
        metadata per KV-cache group (they share ``query_start_loc`` and ``seq_lens``), layer L
        reading ``metas[L.kv_group]``; ``lora_slots`` [T] int32: each row's LoRA slot (-1:
        none), or None. None, with nothing done, if the step is not one decode token per
        request in request order, has adapters and the layers no LoRA slots (or the caches'
        shape is beyond the kernel)."""
        rows = x.shape[0]
        if len(metas) < self.num_groups or rows == 0 or x.dtype != self.dtype or \
                (self.max_rows is not None and rows > self.max_rows) or \
                not all(map(_is_plain_decode, metas[:self.num_groups])) or \
                (lora_slots is not None and not _slots_fit(lora_slots, rows, self.has_lora)):
            return None
        structs = self._layer_structs(kv_caches)
        if structs is None:
            return None
        x = x.contiguous()
        tables = [(cos.contiguous(), sin.contiguous()) for cos, sin in ropes]  # [T, 1, D] each
        cos_tables, sin_tables = ((ctypes.c_void_p * len(tables))(*(t[i].data_ptr()
                                                                     for t in tables))
                                  for i in (0, 1))  # alive until the call returns
        groups = self._groups_type(*[  # alive until the call returns
            _GroupStruct(m.slot_mapping.data_ptr(), m.plan.decode.block_tables.data_ptr(),
                         m.plan.decode.block_tables.shape[1])
            for m in metas[:self.num_groups]])
        step = _StepStruct(rows, kv_caches[0][0].shape[1],
                           ctypes.cast(cos_tables, ctypes.c_void_p),
                           ctypes.cast(sin_tables, ctypes.c_void_p), groups,
                           metas[0].plan.decode.seq_lens.data_ptr(), self._seconds_pointer,
                           None if lora_slots is None else lora_slots.data_ptr(),
                           self._kv_type)
        self._seconds.router = self._seconds.experts = 0.0
        residual = torch.empty_like(x)
        self.function(structs, len(self.layers), ctypes.byref(step), x.data_ptr(),
                      residual.data_ptr())
        self.num_steps += 1
        return x, residual

    @property
    def moe_seconds(self) -> tuple[float, float]:
        """(router, experts): the last step's seconds in the routers of its mixture-of-experts
        layers (linear and top-k) and in their experts (routed and shared), summed over them
        (zero for dense layers)."""
        return self._seconds.router, self._seconds.experts

    def _layer_structs(self, kv_caches) -> ctypes.Array | None:
        """The layers' structs over these caches (built once per cache set), or None where the
        decode kernel does not take their shape."""
        caches = [(k.data_ptr(), v.data_ptr()) for k, v in kv_caches]
        if caches == self._caches:
            return self._structs
        self._structs, self._caches = None, caches
        block_size, cache_dtype = kv_caches[0][0].shape[1], kv_caches[0][0].dtype
        if len(kv_caches) != len(self.layers) or any(
                k.dtype != cache_dtype or not _caches_fit(layer, k, v, self.dtype, block_size)
                for layer, (k, v) in zip(self.layers, kv_caches)):
            return None
        # what the caches hold: the model's dtype (0) or an FP8 format (``abi``'s kv_type)
        self._kv_type = 0 if cache_dtype == self.dtype else native.FP8_CACHES[cache_dtype][1]
        self._structs = (_LayerStruct * len(self.layers))(*(
            _layer_struct(layer, moe, k, v, loras, roundings)
            for layer, moe, (k, v), loras, roundings in zip(
                self.layers, self._moes, kv_caches, self._loras, self.roundings)))
        return self._structs


def _is_plain_decode(meta: AttentionMetadata) -> bool:
    """Whether every row of the step decodes, row b for request b, on the C++ kernel."""
    plan = meta.plan
    return isinstance(plan, AttentionPlan) and not plan.groups and plan.decode is not None and \
        plan.decode.rows is None and meta.slot_mapping.dtype == torch.int64 and \
        meta.slot_mapping.is_contiguous()


def _slots_fit(slots: torch.Tensor, rows: int, has_lora: bool) -> bool:
    return has_lora and slots.dtype == torch.int32 and slots.shape == (rows,) and \
        slots.device.type == "cpu" and slots.is_contiguous()


def _runs_here(layer: DecoderLayerPlan, dtype: torch.dtype) -> bool:
    """Whether the C++ step has a kernel for every piece of ``layer``, and its pieces fit
    together (the C++ side trusts the shapes)."""
    a, linears = layer.attention, _linears(layer)
    q_norm, k_norm = _qk_norms(layer)
    norms = [n for n in (layer.attn_norm, layer.attn_out_norm, layer.mlp_norm,
                         layer.mlp_out_norm, q_norm, k_norm) if n is not None]
    if layer.activation not in ACTIVATIONS or a.head_dim % 2 or layer.kv_group < 0 or \
            a.sinks is not None or \
            (a.window is not None and a.window <= 0) or \
            (a.softcap is not None and a.softcap <= 0) or \
            (layer.clip_qkv is not None and not layer.clip_qkv > 0) or \
            (layer.projection_norms is not None and a.q_norm is not None) or \
            a.head_dim > fused.rope_max_head_dim() or (a.q_norm is None) != (a.k_norm is None) or \
            (a.q_norm is not None and a.q_norm[1:] != a.k_norm[1:]) or \
            not all(isinstance(linear, QuantLinear) or
                    isinstance(linear, PanelLinear) and linear.dtype == dtype
                    for linear in linears) or \
            not all(t.dtype == dtype and t.is_contiguous() for n in norms
                    for t in (n.weight, n.bias) if t is not None) or \
            any(n.layer for n in (q_norm, k_norm) if n is not None) or \
            (layer.parallel and layer.moe is not None):
        return False
    qkv, o = linears[:2]
    hidden, q_size, kv_size = qkv.in_features, a.num_heads * a.head_dim, \
        a.num_kv_heads * a.head_dim
    attention_fits = o.out_features == hidden and o.in_features == q_size and \
        qkv.out_features == q_size + 2 * kv_size and \
        (layer.projection_norms is None or q_norm.weight.shape == (q_size,) and
         k_norm.weight.shape == (kv_size,))
    if not _loras_fit(layer, dtype):
        return False
    if layer.moe is not None:
        return attention_fits and _moe_fits(layer.moe, layer.activation, hidden, dtype)
    gate_up, down = linears[2:]
    return attention_fits and _mlp_fits(gate_up, down, hidden, layer.gated)


def _loras_fit(layer: DecoderLayerPlan, dtype: torch.dtype) -> bool:
    """Whether the layer's LoRA tables (if any) are what lora.cpp reads: the model's dtype,
    contiguous, shaped for their projections, the rank split evenly over the parts."""
    if layer.lora is None:
        return True
    projections = (layer.qkv, layer.o, layer.gate_up, layer.down)
    return all(table is None or linear is not None and
               lora.table_fits(table, linear.in_features, linear.out_features, dtype)
               for table, linear in zip(layer.lora, projections, strict=True))


def _mlp_fits(gate_up, down, hidden: int, gated: bool = True) -> bool:
    return gate_up.in_features == down.out_features == hidden and \
        gate_up.out_features == (2 if gated else 1) * down.in_features


def _moe_fits(moe: MoePlan, activation: str, hidden: int, dtype: torch.dtype) -> bool:
    experts, router, shared = moe.experts, moe.router, _shared(moe)
    # the router scores all of its experts, of which ``experts`` may hold a share
    if not isinstance(experts, PanelExperts) or experts.dtype != dtype or \
            experts.activation != activation or experts.hidden != hidden or \
            router.in_features != hidden or experts.first_expert < 0 or \
            experts.first_expert + experts.num_experts > router.out_features or \
            not 1 <= moe.top_k <= router.out_features:
        return False
    if shared is None:
        return moe.shared_gate_up is moe.shared_down is moe.shared_gate is None
    gate_up, down, gate = shared
    return _mlp_fits(gate_up, down, hidden) and \
        (gate is None or (gate.in_features == hidden and gate.out_features == 1))


def _caches_fit(layer: DecoderLayerPlan, k: torch.Tensor, v: torch.Tensor, dtype,
                block_size: int) -> bool:
    a = layer.attention
    return decode_attention.supports(dtype, a.num_heads, a.num_kv_heads, a.head_dim,
                                     block_size, k.dtype) and \
        v.dtype == k.dtype and k.is_contiguous() and v.is_contiguous() and v.shape == k.shape and \
        k.shape[1:] == (block_size, a.num_kv_heads, a.head_dim)


def _linears(layer: DecoderLayerPlan) -> list:
    """The layer's linear layers: attention's, then the dense MLP's or the router and the
    shared expert's."""
    if layer.moe is None:
        return [layer.qkv, layer.o, layer.gate_up, layer.down]
    return [layer.qkv, layer.o, layer.moe.router,
            *(linear for linear in _shared(layer.moe) or () if linear is not None)]


def _shared(moe: MoePlan) -> tuple | None:
    """(gate_up, down, gate) of the shared expert (gate None: unscaled, Granite's), or None
    without one (or with part of one: not a layer the step takes)."""
    if moe.shared_gate_up is None or moe.shared_down is None:
        return None
    return moe.shared_gate_up, moe.shared_down, moe.shared_gate


def _qk_norms(layer: DecoderLayerPlan) -> tuple[Norm | None, Norm | None]:
    """The layer's q and k norms: over the whole projections, or per head, or none."""
    if layer.projection_norms is not None:
        return layer.projection_norms
    return layer.attention.q_norm, layer.attention.k_norm


def _norm_struct(norm: Norm | None) -> _NormStruct:
    if norm is None:
        return _NormStruct(None, 0.0, 0, None, 0)
    return _NormStruct(norm.weight.data_ptr(), norm.eps, int(norm.unit_offset),
                       None if norm.bias is None else norm.bias.data_ptr(), int(norm.layer))


def _without_fp8_inputs(layer: DecoderLayerPlan) -> tuple[DecoderLayerPlan, tuple]:
    """The layer with the FP8 rounding taken off its projections' inputs, which the C++ step
    does itself (``round_to_fp8``), and those roundings: qkv's, o's, gate_up's, down's (None:
    none). A rounding over ranks (``row_max``) stays on: the step takes no such layer."""
    linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
    roundings = tuple(linear.quant if isinstance(linear, QuantizedInputs) and
                      linear.row_max is None else None for linear in linears)
    qkv, o, gate_up, down = (linear if rounding is None else linear.linear
                             for linear, rounding in zip(linears, roundings))
    return layer._replace(qkv=qkv, o=o, gate_up=gate_up, down=down), roundings


def _linear_struct(linear: PanelLinear | QuantLinear | None,
                   rounding: ActivationQuant | None = None) -> _LinearStruct:
    if linear is None:  # none there: zero features
        return _LinearStruct()
    if isinstance(linear, QuantLinear):
        struct = _LinearStruct.from_buffer_copy(linear.struct)
    else:
        bias = linear.padded_bias
        struct = _LinearStruct(linear.packed.data_ptr(),
                               None if bias is None else bias.data_ptr(),
                               linear.out_features, linear.in_features)
    if rounding is not None:
        struct.fp8_inputs, struct.fp8_group = 1, rounding.group or 0
        struct.fp8_scale = rounding.scale or 0.0
    return struct


def _moe_struct(moe: MoePlan) -> _MoeStruct:
    return _MoeStruct(_linear_struct(moe.router), moe.experts.struct, moe.top_k,
                      int(moe.renormalize),
                      *map(_linear_struct, (moe.shared_gate_up, moe.shared_down,
                                            moe.shared_gate)))


def _lora_structs(tables) -> list[_LoRAStruct] | None:
    """The structs of a layer's LoRA tables (qkv, o, gate_up, down; a zeroed one where a
    projection has none); None without LoRA."""
    if tables is None:
        return None
    return [_LoRAStruct() if table is None else lora.table_struct(table) for table in tables]


def _layer_struct(layer: DecoderLayerPlan, moe: _MoeStruct | None, k_cache,
                  v_cache, loras, roundings: tuple) -> _LayerStruct:
    """``moe``: the layer's experts' struct, which the caller keeps alive, or None; ``loras``:
    its LoRA structs (``_lora_structs``), or None; ``roundings``: its projections' FP8
    input roundings (``_without_fp8_inputs``)."""
    a = layer.attention
    lora = {} if loras is None else dict(zip(("qkv_lora", "o_lora", "gate_up_lora",
                                              "down_lora"), loras))
    return _LayerStruct(
        *map(_norm_struct, (layer.attn_norm, layer.attn_out_norm, layer.mlp_norm,
                            layer.mlp_out_norm, *_qk_norms(layer))),
        *map(_linear_struct, (layer.qkv, layer.o, layer.gate_up, layer.down), roundings),
        k_cache.data_ptr(), v_cache.data_ptr(), a.num_heads, a.num_kv_heads, a.head_dim,
        ACTIVATIONS.index(layer.activation), layer.rope, a.scale, a.window or 0,
        a.softcap or 0.0, layer.kv_group, int(layer.projection_norms is not None),
        layer.clip_qkv or 0.0,
        1.0 if layer.residual_scale is None else layer.residual_scale,
        None if moe is None else ctypes.pointer(moe), **lora, parallel=int(layer.parallel),
        gated=int(layer.gated))
