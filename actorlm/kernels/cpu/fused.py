"""A decoder layer's elementwise steps fused into one pass each on a CPU (``csrc/fused.cpp``).

Each falls back to its torch twin in ``kernels/portable.py`` where the C++ library is not built
(``native``) or the tensors are not what it takes (another device or dtype, strided). Each
replaces several torch ops (each a dispatch, and for bf16 a round trip through fp32 copies):
``add_rms_norm`` nine, ``act_and_mul`` three, ``rope_and_write_kv`` (RoPE on q and k, then the
new K/V into the paged cache) six, ``round_to_fp8`` (an FP8 checkpoint's rounding of a linear
layer's input) ten. ``argmax`` is a greedy step's pick over the vocabulary,
which torch runs on one thread per row here.
"""

from __future__ import annotations

import functools

import torch

from actorlm.kernels import portable
from actorlm.kernels.backend import ACTIVATIONS, ActivationQuant, Norm, check_activation
from actorlm.kernels.cpu import native


def rms_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    """``norm`` of each row of x [T, H] (rows may be strided) -> a new [T, H] tensor."""
    fn = _function("actorlm_rms_norm", x, norm.weight, dense_rows=False)
    if fn is None or x.dim() != 2:
        return portable.rms_norm(x, norm)
    out = x.new_empty(x.shape)
    fn(x.data_ptr(), x.stride(0), out.data_ptr(), norm.weight.data_ptr(), x.shape[0],
       x.shape[1], norm.eps, norm.unit_offset)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor,
                 norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual): x and residual [T, H], both may be written."""
    fn = _function("actorlm_add_rms_norm", x, residual, norm.weight)
    if fn is None:
        return portable.add_rms_norm(x, residual, norm)
    fn(x.data_ptr(), residual.data_ptr(), norm.weight.data_ptr(), x.shape[0], x.shape[1],
       norm.eps, norm.unit_offset)
    return x, residual


def head_rms_norm(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  q_norm: Norm, k_norm: Norm) -> bool:
    """Each q head and k head of the fused projection qkv [T, (Hq + 2 Hkv) * D] normed in
    place (q heads by ``q_norm``, k heads by ``k_norm``, alike but for their weights). False,
    with nothing done, where the kernel does not take these tensors."""
    fn = _function("actorlm_head_rms_norm", qkv, q_norm.weight, k_norm.weight,
                   dense_rows=False)
    if fn is None or (q_norm.eps, q_norm.unit_offset) != (k_norm.eps, k_norm.unit_offset) or \
            qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim:
        return False
    fn(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], num_heads, num_kv_heads, head_dim,
       q_norm.weight.data_ptr(), k_norm.weight.data_ptr(), q_norm.eps, q_norm.unit_offset)
    return True


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """gate_up [T, 2I] (each row [gate | up]) -> act(gate) * up [T, I]."""
    check_activation(activation)
    fn = _function("actorlm_act_and_mul", gate_up)
    if fn is None:
        return portable.act_and_mul(gate_up, activation)
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    fn(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1],
       ACTIVATIONS.index(activation))
    return out


def rope_and_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_heads: int, num_kv_heads: int) -> bool:
    """In one pass: the q and k heads of each row of a fused projection qkv
    [T, (Hq + 2 Hkv) * D] rotated in place as ``portable.apply_rope`` rotates them (cos,
    sin_signed: [T, 1, D]), and each row's k and v heads written into the paged caches
    ([num_blocks, block_size, Hkv, D]; in the model's dtype, or FP8: rounded as
    ``portable.cache_values`` rounds) at its slot. False, with nothing done, where the kernel
    does not take these tensors; the caller then runs the torch ops."""
    head_dim = k_cache.shape[-1]
    suffix = native.cache_suffix(qkv.dtype, k_cache.dtype)  # (an FP8 cache's own kernel)
    if _function("actorlm_rope_write_kv", qkv, cos, sin_signed, dense_rows=False) is None or \
            suffix is None or v_cache.dtype != k_cache.dtype or \
            not (k_cache.is_contiguous() and v_cache.is_contiguous()) or \
            head_dim % 2 or head_dim > rope_max_head_dim() or \
            qkv.shape[1] != (num_heads + 2 * num_kv_heads) * head_dim or \
            k_cache.shape != v_cache.shape or k_cache.shape[-2] != num_kv_heads or \
            cos.numel() != qkv.shape[0] * head_dim or sin_signed.shape != cos.shape or \
            slot_mapping.dtype != torch.int64 or slot_mapping.shape != (qkv.shape[0],) or \
            not slot_mapping.is_contiguous():
        return False
    native.function(f"actorlm_rope_write_kv_{suffix}")(
        qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin_signed.data_ptr(), k_cache.data_ptr(),
        v_cache.data_ptr(), slot_mapping.data_ptr(), qkv.shape[0], num_heads, num_kv_heads,
        head_dim)
    return True


def widened(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An FP8 cache's values x in ``dtype``, exactly (``x.to(dtype)``, at several times its
    speed where the library runs); x itself where it is in ``dtype`` already."""
    if x.dtype == dtype:
        return x
    suffix = native.cache_suffix(dtype, x.dtype)
    fn = None if suffix is None or x.device.type != "cpu" or not x.is_contiguous() else \
        native.function(f"actorlm_widen_{suffix}")
    if fn is None:
        return x.to(dtype)
    out = torch.empty(x.shape, dtype=dtype)
    fn(x.data_ptr(), out.data_ptr(), x.numel())
    return out


@functools.cache
def rope_max_head_dim() -> int:
    """The largest head size ``rope_and_write_kv`` takes (0 without the library)."""
    fn = native.function("actorlm_rope_max_head_dim")
    return 0 if fn is None else fn()


def round_to_fp8(x: torch.Tensor, quant: ActivationQuant) -> torch.Tensor:
    """x [T, in] rounded to FP8 and back (``csrc/fp8.cpp``), as ``portable.round_to_fp8``
    rounds it, with the same bits."""
    fn = _function("actorlm_round_to_fp8", x, dense_rows=False) if x.dim() == 2 else None
    if fn is None:
        return portable.round_to_fp8(x, quant)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    fn(x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], x.shape[1], quant.group or 0,
       quant.scale or 0.0)
    return out


class QuantizedInputs(portable.QuantizedInputs):
    """The portable layer whose input is rounded to FP8 first, rounding on the C++ kernel
    (but over ranks, ``row_max``, which only the portable rounding joins)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_max is not None:
            return super().__call__(x)
        return self.linear(round_to_fp8(x, self.quant))


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] fp32 (no NaN) -> [N] int64, the first index of each row's maximum."""
    fn = _function("actorlm_argmax", logits) if logits.dtype == torch.float32 else None
    if fn is None:
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    fn(logits.data_ptr(), out.data_ptr(), logits.shape[0], logits.shape[1])
    return out


def _function(name: str, first: torch.Tensor, *others: torch.Tensor, dense_rows: bool = True):
    """The C++ function ``name`` for these tensors — on the CPU, of one dtype it has a
    function for, contiguous (``first`` with only its last dimension dense where
    ``dense_rows`` is False) — or None."""
    suffix = native.dtype_suffix(first.dtype)
    if first.device.type != "cpu" or suffix is None or first.shape[0] == 0 or \
            first.stride(-1) != 1 or (dense_rows and not first.is_contiguous()) or \
            any(t.dtype != first.dtype or not t.is_contiguous() for t in others):
        return None
    return native.function(f"{name}_{suffix}")
