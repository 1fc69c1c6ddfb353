"""Writing new K/V into their slots of the paged KV cache (Triton); the oracle is
``write_kv_ref`` in ``reference.py``."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8_MAX: tl.constexpr,  # an FP8 cache's largest finite value; 0: not FP8
    FP8_MANTISSA: tl.constexpr,  # its mantissa bits
    FP8_MIN_EXP: tl.constexpr,  # its smallest normal exponent
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: nothing to write
        return
    block_id = slot // BLOCK_SIZE
    block_offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]  # [BLOCK_H, BLOCK_D]

    k = tl.load(key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    k_dst = k_cache_ptr + block_id * stride_kcb + block_offset * stride_kcs
    v_dst = v_cache_ptr + block_id * stride_vcb + block_offset * stride_vcs
    tl.store(k_dst + offs_h[:, None] * stride_kch + offs_d[None, :], _stored(k, k_cache_ptr, FP8_MAX, FP8_MANTISSA, FP8_MIN_EXP), mask=mask)
    tl.store(v_dst + offs_h[:, None] * stride_vch + offs_d[None, :], _stored(v, v_cache_ptr, FP8_MAX, FP8_MANTISSA, FP8_MIN_EXP), mask=mask)


@triton.jit
def _stored(x, cache_ptr, FP8_MAX: tl.constexpr, FP8_MANTISSA: tl.constexpr,
            FP8_MIN_EXP: tl.constexpr):
    """x as the cache holds it: an FP8 cache's values saturated at its largest finite one and
    rounded to the nearest, ties to even (``reference.write_kv_ref``). The rounding is done in
    fp32, so that the conversion only moves exact values: Triton's interpreter converts
    1.96 to E4M3 as 1.0 (a lost carry into the exponent)."""
    if FP8_MAX > 0:
        x = tl.clamp(x.to(tl.float32), -FP8_MAX, FP8_MAX)
        # the FP8 grid's spacing at x, 2^s (subnormals: the smallest normal exponent's), and
        # |x| + 1.5 * 2^(s + 23) - that: fp32's own rounding to a multiple of 2^s (of |x|, its
        # sign put back after: a negative x rounding to zero keeps it)
        bits = x.to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 0xFF) - 127
        spacing = tl.maximum(exponent, FP8_MIN_EXP) - FP8_MANTISSA
        magic = (((spacing + 23 + 127) << 23) | (1 << 22)).to(tl.float32, bitcast=True)
        size = (tl.abs(x) + magic) - magic
        return tl.where(bits < 0, -size, size).to(cache_ptr.dtype.element_ty)  # (-0 too)
    return x.to(cache_ptr.dtype.element_ty)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` of each token into its cache slot, in place; slot < 0 is skipped.

    key, value: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    slot_mapping: [T] int64 with slot = block_id * block_size + offset.
    """
    assert key.dim() == 3 and key.shape == value.shape, (key.shape, value.shape)
    assert k_cache.dim() == 4 and k_cache.shape == v_cache.shape, (k_cache.shape, v_cache.shape)
    num_tokens, num_kv_heads, head_dim = key.shape
    _, block_size, cache_heads, cache_dim = k_cache.shape
    assert (cache_heads, cache_dim) == (num_kv_heads, head_dim), (k_cache.shape, key.shape)
    assert slot_mapping.shape == (num_tokens,), (slot_mapping.shape, num_tokens)
    assert slot_mapping.dtype in (torch.int64, torch.int32), slot_mapping.dtype
    for t in (key, value, k_cache, v_cache):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    assert k_cache.dtype == v_cache.dtype and key.dtype == value.dtype
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        **_fp8_grid(k_cache.dtype),
    )


def _fp8_grid(dtype: torch.dtype) -> dict:
    """The constants of an FP8 cache's values (none: not FP8)."""
    if dtype.itemsize != 1:
        return dict(FP8_MAX=0.0, FP8_MANTISSA=0, FP8_MIN_EXP=0)
    info = torch.finfo(dtype)
    return dict(FP8_MAX=info.max, FP8_MANTISSA=-int(math.log2(info.eps)),
                FP8_MIN_EXP=int(math.log2(info.smallest_normal)))
