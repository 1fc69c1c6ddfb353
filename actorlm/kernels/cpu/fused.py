"""A decoder layer's elementwise steps fused into one pass each on a CPU
(``csrc/fused.cpp``), each with its torch twin, which runs where the C++ library is not
built (``native``) or the tensors are not what it takes (another device or dtype, strided).

Each replaces several torch ops (each a dispatch, and for bf16 a round trip through fp32
copies): ``add_rms_norm`` nine, ``silu_and_mul`` three, ``rope_and_write_kv`` (RoPE on q and k,
then the new K/V into the paged cache) six. ``argmax`` is a greedy step's pick over
the vocabulary, which torch runs on one thread per row here.
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from actorlm.kernels.cpu import native

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rms_norm(x + residual), x + residual), as HF's layer computes them: x and
    residual [T, H], weight [H]. May write into x and residual."""
    fn = _function("actorlm_add_rms_norm", x, residual, weight)
    if fn is None:
        return add_rms_norm_ref(x, residual, weight, eps)
    fn(x.data_ptr(), residual.data_ptr(), weight.data_ptr(), x.shape[0], x.shape[1], eps)
    return x, residual


def add_rms_norm_ref(x, residual, weight, eps):
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm with its bits: x [T, H] * rsqrt(mean(x^2) + eps), in fp32, times weight."""
    if x.dtype == torch.float32:  # one op (torch.rms_norm has HF's fp32 bits)
        return torch.rms_norm(x, weight.shape, weight, eps)
    # normalise in fp32, cast back, then scale (HF's order: it changes bf16 results)
    return weight * torch.rms_norm(x.float(), weight.shape, None, eps).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (each row [gate | up]) -> silu(gate) * up [T, I]."""
    fn = _function("actorlm_silu_and_mul", gate_up)
    if fn is None:
        return silu_and_mul_ref(gate_up)
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    fn(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1])
    return out


def silu_and_mul_ref(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_and_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_heads: int, num_kv_heads: int) -> bool:
    """In one pass: the q and k heads of each row of a fused projection qkv
    [T, (Hq + 2 Hkv) * D] rotated in place as ``apply_rope`` rotates them (cos, sin_signed:
    [T, 1, D]), and each row's k and v heads written into the paged caches
    ([num_blocks, block_size, Hkv, D]) at its slot. False, with nothing done, where the kernel
    does not take these tensors; the caller then runs the torch ops."""
    head_dim = k_cache.shape[-1]
    fn = _function("actorlm_rope_write_kv", qkv, cos, sin_signed, k_cache, v_cache)
    if fn is None or head_dim % 2 or head_dim > rope_max_head_dim() or \
            qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or \
            k_cache.shape != v_cache.shape or k_cache.shape[-2] != num_kv_heads or \
            cos.numel() != qkv.shape[0] * head_dim or sin_signed.shape != cos.shape or \
            slot_mapping.dtype != torch.int64 or slot_mapping.shape != (qkv.shape[0],) or \
            not slot_mapping.is_contiguous():
        return False
    fn(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin_signed.data_ptr(), k_cache.data_ptr(),
       v_cache.data_ptr(), slot_mapping.data_ptr(), qkv.shape[0], num_heads, num_kv_heads,
       head_dim)
    return True


@functools.cache
def rope_max_head_dim() -> int:
    """The largest head size ``rope_and_write_kv`` takes (0 without the library)."""
    lib = native.library()
    return 0 if lib is None else lib.actorlm_rope_max_head_dim()


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] fp32 (no NaN) -> [N] int64, the first index of each row's maximum."""
    if logits.dtype != torch.float32:
        return logits.argmax(dim=-1)
    fn = _function("actorlm_argmax", logits)
    if fn is None:
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    fn(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1])
    return out


def _function(name: str, *tensors: torch.Tensor):
    """The C++ function for these tensors (CPU, contiguous, one dtype it takes), or None."""
    first = tensors[0]
    suffix = native.dtype_suffix(first.dtype)
    if first.device.type != "cpu" or suffix is None or first.shape[0] == 0 or \
            any(t.dtype != first.dtype or not t.is_contiguous() for t in tensors):
        return None
    return _load(f"{name}_{suffix}")


@functools.cache
def _load(symbol: str):
    argtypes = {"actorlm_add_rms_norm": [_P, _P, _P, _I64, _INT, _F],
                "actorlm_silu_and_mul": [_P, _P, _I64, _INT],
                "actorlm_argmax": [_P, _P, _I64, _I64],
                "actorlm_rope_write_kv": [_P, _I64, _P, _P, _P, _P, _P, _I64, _INT, _INT, _INT]}
    return native.function(symbol, argtypes[symbol.rsplit("_", 1)[0]])
