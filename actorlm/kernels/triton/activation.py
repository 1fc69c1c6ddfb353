"""Triton gated activation ``act(gate) * up`` in HF transformers' rounding order.

HF computes ``act_fn(gate_proj(x)) * up_proj(x)`` as two ops in the model's dtype, so the
activation (evaluated in fp32 from the widened gate) is rounded to the dtype, and then the
product is. GPT-OSS's clamped SwiGLU (``swiglu_oai``) is the exception: HF rounds it op by op
(g * alpha, the sigmoid, the product, up + 1, the last product), which the kernel does not
copy; it computes it in fp32 and rounds once, as vLLM's ``swigluoai_and_mul`` does (the
oracle's value, to that one rounding). Each program
owns ``BLOCK_R`` rows and a ``BLOCK_I`` slice of the intermediate dimension. The oracle is
``act_and_mul_ref`` in ``reference.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actorlm.kernels.backend import (ACTIVATIONS, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT,
                                     check_activation)
from actorlm.kernels.triton.norms import round_to

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_GELU_COEFF = tl.constexpr(0.044715)
_INVERSE_SQRT_2 = tl.constexpr(0.7071067811865476)
_SWIGLU_OAI_ALPHA = tl.constexpr(SWIGLU_OAI_ALPHA)
_SWIGLU_OAI_LIMIT = tl.constexpr(SWIGLU_OAI_LIMIT)
# the kernels' ACTIVATION values, by name: a reordered ACTIVATIONS cannot mismatch them
_SILU, _GELU_TANH, _RELU, _RELU2, _GELU, _SWIGLU_OAI = (
    tl.constexpr(ACTIVATIONS.index(name))
    for name in ("silu", "gelu_tanh", "relu", "relu2", "gelu", "swiglu_oai"))
_MAX_BLOCK_I = 1024
_TILE_GPU = 4096  # elements of a [BLOCK_R, BLOCK_I] tile
_TILE_CPU = 65536  # the interpreter's cost is per operation, not per element

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _activation(gate, ACTIVATION: tl.constexpr):
    """act(gate) in fp32 for the activations of one argument; an index without a branch here
    fails to compile rather than run another activation."""
    if ACTIVATION == _SILU:
        act = gate * tl.sigmoid(gate)
    elif ACTIVATION == _GELU_TANH:
        # 0.5 g (1 + tanh(y)) == g * sigmoid(2y): tl has no tanh, and this form does not cancel
        # for negative g (1 + tanh(y) does).
        y = _SQRT_2_OVER_PI * (gate + _GELU_COEFF * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * y)
    elif ACTIVATION == _RELU:
        act = tl.maximum(gate, 0.0)
    elif ACTIVATION == _RELU2:
        act = tl.maximum(gate, 0.0) * tl.maximum(gate, 0.0)
    elif ACTIVATION == _GELU:  # exact, by erf
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * _INVERSE_SQRT_2))
    else:
        tl.static_assert(False, "no activation of this index")
    return act


@triton.jit
def gated_activation(gate, up, DTYPE: tl.constexpr, ACTIVATION: tl.constexpr):
    """act(gate) * up in ``DTYPE`` from fp32 tiles of gate and up (values of ``DTYPE``): the
    activation (``ACTIVATION``: its index in ``ACTIVATIONS``) rounded to ``DTYPE``, then the
    product (HF's two ops); ``swiglu_oai`` in fp32, rounded once. Also the routed experts'
    epilogue (``fused_moe.py``)."""
    if ACTIVATION == _SWIGLU_OAI:  # (clamp(up, -L, L) + 1) g sigmoid(alpha g), g = min(gate, L)
        gate = tl.minimum(gate, _SWIGLU_OAI_LIMIT)
        up = tl.minimum(tl.maximum(up, -_SWIGLU_OAI_LIMIT), _SWIGLU_OAI_LIMIT)
        out = gate * tl.sigmoid(gate * _SWIGLU_OAI_ALPHA) * (up + 1.0)
    else:
        out = round_to(_activation(gate, ACTIVATION), DTYPE).to(tl.float32) * up
    return round_to(out, DTYPE)


@triton.jit
def _act_and_mul_kernel(
    out_ptr,  # [T, I]
    gate_up_ptr,  # [T, 2I], each row [gate | up]
    num_rows,
    inter,  # I
    stride_out,
    stride_in,
    ACTIVATION: tl.constexpr,  # its index in ACTIVATIONS
    BLOCK_R: tl.constexpr,
    BLOCK_I: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BLOCK_R]
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I]
    mask = (rows < num_rows)[:, None] & (cols < inter)[None, :]  # [BLOCK_R, BLOCK_I]
    gate_ptrs = gate_up_ptr + rows[:, None] * stride_in + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    out = gated_activation(gate, up, dtype, ACTIVATION)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], out, mask=mask)


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """act(gate) * up for gate_up [T, 2I] (each row [gate | up], stride(1) == 1); ``activation``
    is one of ``ACTIVATIONS`` (``gelu_tanh``: torch's ``gelu(approximate="tanh")``). Returns
    [T, I] in gate_up's dtype."""
    check_activation(activation)
    assert gate_up.dim() == 2 and gate_up.dtype in _FLOAT_DTYPES, (gate_up.shape, gate_up.dtype)
    assert gate_up.stride(1) == 1, f"gate_up: rows must be contiguous, strides {gate_up.stride()}"
    num_rows, width = gate_up.shape
    assert width % 2 == 0, f"gate_up: [T, 2I] wanted, got {tuple(gate_up.shape)}"
    inter = width // 2
    out = torch.empty((num_rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_rows == 0 or inter == 0:
        return out
    block_i = min(triton.next_power_of_2(inter), _MAX_BLOCK_I)
    tile = _TILE_GPU if gate_up.device.type == "cuda" else _TILE_CPU
    block_r = min(triton.next_power_of_2(num_rows), max(1, tile // block_i))
    grid = (triton.cdiv(num_rows, block_r), triton.cdiv(inter, block_i))
    _act_and_mul_kernel[grid](
        out, gate_up, num_rows, inter, out.stride(0), gate_up.stride(0),
        ACTIVATION=ACTIVATIONS.index(activation),
        BLOCK_R=block_r,
        BLOCK_I=block_i,
        num_warps=max(1, min(8, block_r * block_i // 512)),
    )
    return out
