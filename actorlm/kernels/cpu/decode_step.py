"""A decode step through every decoder layer in one C++ call (``csrc/decode_step.cpp``).

The layers run the kernels the Python layers call, in the same order with the same bits; only
the Python between them goes. A decode step streams the weights through the caches, evicting
the interpreter's working set, so each Python-level op after a GEMV costs tens of microseconds
of cache misses: ten per layer were a fifth of a one-request SmolLM2 step.

It takes a model on a CPU whose every piece has its C++ kernel here (the panel GEMM, which
needs AVX-512, and for bf16 avx512_bf16; RoPE; decode attention for this head shape), on one
rank, without q/k norms (Qwen3), and a step whose every request decodes one token (in bf16, one
or two requests: beyond, oneDNN's AMX GEMM runs the linear layers); anything else runs the
Python layers.
"""

from __future__ import annotations

import ctypes

import torch

from actorlm.kernels.cpu import decode_attention, fused, native
from actorlm.kernels.cpu.attention import AttentionPlan
from actorlm.kernels.cpu.linear import PanelLinear

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float


class _Layer(ctypes.Structure):
    _fields_ = [(name, _P) for name in (
        "input_norm", "post_attention_norm", "qkv", "qkv_bias", "o", "o_bias", "gate_up",
        "gate_up_bias", "down", "down_bias", "k_cache", "v_cache")]


class _Shape(ctypes.Structure):
    _fields_ = [("hidden", _I64), ("intermediate", _I64), ("num_heads", _I32),
                ("num_kv_heads", _I32), ("head_dim", _I32), ("block_size", _I32),
                ("eps", _F), ("scale", _F)]


class _Step(ctypes.Structure):
    _fields_ = [("rows", _I64), ("cos", _P), ("sin_signed", _P), ("slots", _P),
                ("block_tables", _P), ("max_blocks", _I32), ("seq_lens", _P), ("qkv", _P),
                ("attention", _P), ("gate_up", _P), ("activation", _P)]


class DecodeLayers:
    """``model``'s decoder layers as one call for pure decode steps; ``build`` says whether the
    model qualifies, ``__call__`` whether the step does."""

    def __init__(self, model, function, max_rows: int | None):
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        self.layers = model.model.layers
        self.function, self.max_rows, self.dtype = function, max_rows, model.dtype
        self.q_size, self.kv_size = attn.q_size, attn.kv_size
        self.intermediate = mlp.intermediate_size
        self.head_dim = attn.head_dim
        self.shape = _Shape(model.config.hidden_size, self.intermediate, attn.num_heads,
                            attn.num_kv_heads, attn.head_dim, 0,
                            model.model.layers[0].input_layernorm.eps, attn.scale)
        self._array, self._caches = None, None  # the layers' structs, for these KV caches

    @classmethod
    def build(cls, model) -> DecodeLayers | None:
        suffix = native.dtype_suffix(model.dtype)
        attn = model.model.layers[0].self_attn
        if suffix is None or model.tp.is_parallel or attn.head_dim % 2 or \
                attn.head_dim > fused.rope_max_head_dim():
            return None
        function = native.function(f"actorlm_decode_layers_{suffix}",
                                   [_P, ctypes.c_int, _P, _P, _P, _P])
        linears = [linear for layer in model.model.layers for linear in _packed_linears(layer)]
        if function is None or any(layer.self_attn.q_norm is not None
                                   for layer in model.model.layers) or \
                not all(isinstance(linear, PanelLinear) for linear in linears):
            return None
        limits = [linear.max_rows for linear in linears if linear.max_rows is not None]
        return cls(model, function, min(limits, default=None))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                 kv_caches, meta) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the last layer's output, the residual stream before it) for the embeddings x
        [T, hidden], as the Python layers compute them, bit for bit; None, with nothing done,
        if the step is not one decode token per request in request order (or the caches' shape
        is beyond the kernel)."""
        plan, rows = meta.plan, x.shape[0]
        if not isinstance(plan, AttentionPlan) or plan.groups or plan.decode is None or \
                plan.decode.rows is not None or rows == 0 or \
                (self.max_rows is not None and rows > self.max_rows) or \
                meta.slot_mapping.dtype != torch.int64 or not meta.slot_mapping.is_contiguous():
            return None
        layers = self._layers(kv_caches)
        if layers is None:
            return None
        decode = plan.decode
        widths = [self.q_size + 2 * self.kv_size, self.q_size, 2 * self.intermediate,
                  self.intermediate]
        qkv, attention, gate_up, activation = x.new_empty(rows * sum(widths)).split(
            [rows * width for width in widths])  # each [rows, width], dense
        cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
        step = _Step(rows, cos.data_ptr(), sin_signed.data_ptr(), meta.slot_mapping.data_ptr(),
                     decode.block_tables.data_ptr(), decode.block_tables.shape[1],
                     decode.seq_lens.data_ptr(), qkv.data_ptr(), attention.data_ptr(),
                     gate_up.data_ptr(), activation.data_ptr())
        x, residual = self.layers[0].input_layernorm(x), x  # as the first Python layer does
        self.function(layers, len(self.layers), ctypes.byref(self.shape), ctypes.byref(step),
                      x.data_ptr(), residual.data_ptr())
        return x, residual

    def _layers(self, kv_caches) -> ctypes.Array | None:
        """The layers' structs over these caches (built once per cache set), or None where the
        decode kernel does not take their shape."""
        caches = [(k.data_ptr(), v.data_ptr()) for k, v in kv_caches]
        if caches == self._caches:
            return self._array
        self._array, self._caches = None, caches
        block_size = kv_caches[0][0].shape[1]
        if not decode_attention.supports(self.dtype, self.shape.num_heads, self.shape.num_kv_heads,
                                   self.head_dim, block_size) or \
                any(k.dtype != self.dtype or not k.is_contiguous() or not v.is_contiguous() or
                    k.shape[1:] != (block_size, self.shape.num_kv_heads, self.head_dim) or
                    v.shape != k.shape for k, v in kv_caches):
            return None
        self.shape.block_size = block_size
        array = (_Layer * len(self.layers))()
        for i, (layer, (k, v)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            tensors = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                       *(t for linear in _packed_linears(layer)
                         for t in (linear.packed, linear.padded_bias)),
                       k, v]  # in _Layer's order
            array[i] = _Layer(*(None if t is None else t.data_ptr() for t in tensors))
        self._array = array
        return array


def _packed_linears(layer) -> list:
    """A decoder layer's linear layers as packed, in the order the kernel runs them."""
    return [layer.self_attn.qkv_proj.packed, layer.self_attn.o_proj.packed,
            layer.mlp.gate_up_proj.packed, layer.mlp.down_proj.packed]
