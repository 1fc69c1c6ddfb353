"""Decode attention straight from the paged KV cache on a CPU (``csrc/decode_attention.cpp``).

The torch path gathers each request's K/V blocks into a dense copy and runs SDPA over it: on
two cores that is ~1.2 ms per layer for 64 decode rows at context 140, where reading the
context once costs ~0.35 ms. The C++ kernel reads the blocks in place, costs each request only
its own context, and runs on torch's OpenMP pool. Where the library of C++ kernels is not
built (``native``) the torch path runs.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from actorlm.kernels.cpu import native

class _Library:
    def __init__(self, limits_function):
        limits = [ctypes.c_int() for _ in range(3)]
        limits_function(*map(ctypes.byref, limits))
        self.max_group, self.max_head_dim, self.max_block_size = (v.value for v in limits)
        # (the query's dtype, the caches'): the model's, or an FP8 format
        self.functions = {
            (dtype, cache): native.function(f"actorlm_decode_{native.cache_suffix(dtype, cache)}")
            for dtype in (torch.float32, torch.bfloat16)
            for cache in (dtype, *native.FP8_CACHES)}


def is_built(block_size: int) -> bool:
    """Whether the kernel runs here, for caches of ``block_size`` tokens a block."""
    lib = _library()
    return lib is not None and block_size <= lib.max_block_size


def supports(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
             block_size: int, cache_dtype: torch.dtype | None = None) -> bool:
    """Whether decode rows of this shape can run here (the library built, the shape in its
    limits), over caches of ``cache_dtype`` (None: ``dtype``); otherwise the torch path
    attends them."""
    lib = _library()
    return is_built(block_size) and (dtype, cache_dtype or dtype) in lib.functions and \
        num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= lib.max_group and \
        head_dim <= lib.max_head_dim


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           rows: torch.Tensor | None = None,
                           out: torch.Tensor | None = None, *, window: int | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Attention of one query token per request over its paged context.

    query: [T, Hq, D] (rows may be strided); caches: [num_blocks, block_size, Hkv, D];
    block_tables: [B, max_blocks] int32; seq_lens: [B] int32 (>= 1); rows: [B] int32, the
    query row of each request (None: row b is request b, T == B). Writes those rows of
    ``out`` ([T, Hq, D], contiguous; allocated if None) and returns it. With a ``window``,
    request b reads its last ``window`` positions only, from position
    max(0, seq_lens[b] - window): the table entries of the blocks before that one are never
    read (they may name any block). A ``softcap`` caps the scaled scores at
    ``softcap * tanh(s / softcap)``. Only where ``supports(...)`` holds."""
    num_tokens, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_requests = block_tables.shape[0]
    assert query.stride(2) == 1 and query.stride(1) == head_dim, "query heads must be dense"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and \
        k_cache.shape == v_cache.shape and k_cache.dtype == v_cache.dtype
    assert block_tables.dtype == seq_lens.dtype == torch.int32 and \
        block_tables.is_contiguous() and seq_lens.is_contiguous()
    assert seq_lens.shape == (num_requests,)
    assert window is None or window > 0, window
    assert softcap is None or softcap > 0, softcap
    if rows is None:
        assert num_tokens == num_requests
    else:
        assert rows.dtype == torch.int32 and rows.is_contiguous() and rows.shape == seq_lens.shape
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    assert out.is_contiguous() and out.shape == query.shape and out.dtype == query.dtype
    _library().functions[query.dtype, k_cache.dtype](
        query.data_ptr(), query.stride(0), None if rows is None else rows.data_ptr(),
        k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
        seq_lens.data_ptr(), out.data_ptr(), num_requests, num_heads, num_kv_heads, head_dim,
        block_size, scale, 0 if window is None else window,
        0.0 if softcap is None else softcap)
    return out


@functools.cache
def _library() -> _Library | None:
    limits = native.function("actorlm_decode_limits")
    return None if limits is None else _Library(limits)
