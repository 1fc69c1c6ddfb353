"""Triton LoRA deltas of a batch that mixes adapters, punica's grouped shrink and expand as
vLLM's ``lora_shrink`` / ``lora_expand`` run them: two launches a layer over every group of
rows that shares an adapter slot (``LoRAMapping.segments``: the rows grouped by slot, built
once a step), whatever the number of adapters.

1. shrink: one program per (group, ``BLOCK_M`` of its rows) gathers its rows of x and
   multiplies them by the slot's A: t [n, R] in the dtype, rows in group order.
2. expand: one program per (group, ``BLOCK_M`` rows, ``BLOCK_N`` outputs) multiplies its rows
   of t by the slot's B [R, out] and adds the product to the rows of y it scatters back to.

Each product is rounded to the dtype, then the sum with y, as the torch twin rounds them
(``kernels.lora.add_lora``, the reference); only each matmul's fp32 sum runs in another order.
A row belongs to one group, so no two programs write the same row. The grids are sized from
the host's knowledge of the largest group (no sync); programs past a group's rows return at
once. The tiles are sized by rule, not yet tuned on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actorlm.kernels.lora import LoRAMapping, LoRATable
from actorlm.kernels.triton.fused_moe import _dot
from actorlm.kernels.triton.norms import round_to

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK_M = 16  # tl.dot's least; a decode step's groups are a few rows
_BLOCK_N, _BLOCK_K = 64, 64
# The CPU interpreter's cost is per operation, not per element: wide tiles
_CPU_BLOCK_N, _CPU_BLOCK_K = 256, 256


@triton.jit
def _block_span(starts_ptr, BLOCK_M: tl.constexpr):
    """(first, end): this program's first position in the grouped rows and its group's end;
    first >= end past the group's rows (the grid is sized for the largest group)."""
    first = tl.load(starts_ptr + tl.program_id(0)) + tl.program_id(1) * BLOCK_M
    return first, tl.load(starts_ptr + tl.program_id(0) + 1)


@triton.jit
def _group_rows(rows_ptr, slots_ptr, first, end, R, BLOCK_M: tl.constexpr,
                BLOCK_R: tl.constexpr):
    """This program's positions in the grouped rows [BLOCK_M] from ``first``, which of them
    are its group's, the rows they name (int64), the group's slot, and the rank's columns
    [BLOCK_R] with their mask."""
    positions = first + tl.arange(0, BLOCK_M)
    mask = positions < end
    rows = tl.load(rows_ptr + positions, mask=mask, other=0).to(tl.int64)
    slot = tl.load(slots_ptr + tl.program_id(0)).to(tl.int64)
    ranks = tl.arange(0, BLOCK_R)
    return positions.to(tl.int64), mask, rows, slot, ranks, ranks < R


@triton.jit
def _lora_shrink_kernel(
    t_ptr,  # [n, R]: a row per grouped row
    x_ptr,  # [T, K]
    a_ptr,  # [slots, R, K]
    rows_ptr,  # [n] int32 (LoRASegments)
    starts_ptr,  # [G + 1] int32
    slots_ptr,  # [G] int32
    K,
    R,
    stride_t,
    stride_x,
    stride_as,
    stride_ar,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    dtype = t_ptr.dtype.element_ty
    first, end = _block_span(starts_ptr, BLOCK_M)
    if first >= end:
        return
    positions, mask, rows, slot, ranks, rank_mask = _group_rows(
        rows_ptr, slots_ptr, first, end, R, BLOCK_M, BLOCK_R)
    a_cols = a_ptr + slot * stride_as + ranks[None, :] * stride_ar  # [1, BLOCK_R]
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        k_mask = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :],
                    mask=mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        a = tl.load(a_cols + k[:, None], mask=k_mask[:, None] & rank_mask[None, :],
                    other=0.0)  # [BLOCK_K, BLOCK_R]: A transposed
        acc = _dot(x, a, acc, DOT_IN_FP32)
    tl.store(t_ptr + positions[:, None] * stride_t + ranks[None, :],
             round_to(acc, dtype), mask=mask[:, None] & rank_mask[None, :])


@triton.jit
def _lora_expand_kernel(
    y_ptr,  # [T, N]
    t_ptr,  # [n, R] (the shrink's)
    b_ptr,  # [slots, R, N]
    rows_ptr,
    starts_ptr,
    slots_ptr,
    N,
    R,
    stride_y,
    stride_t,
    stride_bs,
    stride_br,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    dtype = y_ptr.dtype.element_ty
    first, end = _block_span(starts_ptr, BLOCK_M)
    if first >= end:
        return
    positions, mask, rows, slot, ranks, rank_mask = _group_rows(
        rows_ptr, slots_ptr, first, end, R, BLOCK_M, BLOCK_R)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_mask = cols < N
    t = tl.load(t_ptr + positions[:, None] * stride_t + ranks[None, :],
                mask=mask[:, None] & rank_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_R]
    b = tl.load(b_ptr + slot * stride_bs + ranks[:, None] * stride_br + cols[None, :],
                mask=rank_mask[:, None] & col_mask[None, :], other=0.0)  # [BLOCK_R, BLOCK_N]
    delta = round_to(_dot(t, b, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT_IN_FP32),
                     dtype)
    y_ptrs = y_ptr + rows[:, None] * stride_y + cols[None, :]
    out_mask = mask[:, None] & col_mask[None, :]
    y = tl.load(y_ptrs, mask=out_mask, other=0.0)
    tl.store(y_ptrs, round_to(y.to(tl.float32) + delta.to(tl.float32), dtype), mask=out_mask)


def _check_layout(y: torch.Tensor, x: torch.Tensor, table: LoRATable) -> None:
    a, b, _ = table
    assert x.dim() == 2 and y.dim() == 2 and x.shape[0] == y.shape[0], (x.shape, y.shape)
    assert x.dtype in _FLOAT_DTYPES, x.dtype
    for name, t in (("y", y), ("a", a), ("b", b)):
        assert t.dtype == x.dtype and t.device == x.device, \
            f"{name}: {t.dtype} on {t.device}, x: {x.dtype} on {x.device}"
    assert x.stride(1) == 1 and y.stride(1) == 1, f"rows must be contiguous: {x.stride()}, " \
        f"{y.stride()}"
    assert a.shape[2] == x.shape[1] and a.stride(2) == 1, \
        f"a: [slots, R, {x.shape[1]}] with contiguous rows wanted, got {tuple(a.shape)}"
    assert b.shape[:2] == a.shape[:2] and b.shape[2] == y.shape[1] and b.stride(2) == 1, \
        f"b: {(a.shape[0], a.shape[1], y.shape[1])} with contiguous rows wanted, got " \
        f"{tuple(b.shape)}"


def add_lora(y: torch.Tensor, x: torch.Tensor, table: LoRATable,
             mapping: LoRAMapping) -> torch.Tensor:
    """``KernelBackend.add_lora`` (the torch twin: ``kernels.lora.add_lora``): y [T, out] +=
    for the rows of each slot s of ``mapping``, x [T, in] @ table.a[s].T @ table.b[s]; x, y
    and the table of one dtype and device, rows contiguous. Returns y."""
    if not mapping.groups:
        return y
    _check_layout(y, x, table)
    segments = mapping.segments
    num_groups, num_rows = len(mapping.groups), segments.rows.numel()
    (k, n), rank = (x.shape[1], y.shape[1]), table.rank
    on_gpu = x.device.type == "cuda"
    block_r = max(16, triton.next_power_of_2(rank))
    block_k = max(16, min(_BLOCK_K if on_gpu else _CPU_BLOCK_K, triton.next_power_of_2(k)))
    block_n = max(16, min(_BLOCK_N if on_gpu else _CPU_BLOCK_N, triton.next_power_of_2(n)))
    dot_in_fp32 = x.dtype == torch.float32 or not on_gpu
    t = torch.empty((num_rows, rank), dtype=x.dtype, device=x.device)
    row_blocks = triton.cdiv(segments.max_rows, _BLOCK_M)
    _lora_shrink_kernel[(num_groups, row_blocks)](
        t, x, table.a, segments.rows, segments.starts, segments.slots, k, rank, t.stride(0),
        x.stride(0), table.a.stride(0), table.a.stride(1),
        DOT_IN_FP32=dot_in_fp32, BLOCK_M=_BLOCK_M, BLOCK_R=block_r, BLOCK_K=block_k)
    _lora_expand_kernel[(num_groups, row_blocks, triton.cdiv(n, block_n))](
        y, t, table.b, segments.rows, segments.starts, segments.slots, n, rank, y.stride(0),
        t.stride(0), table.b.stride(0), table.b.stride(1),
        DOT_IN_FP32=dot_in_fp32, BLOCK_M=_BLOCK_M, BLOCK_R=block_r, BLOCK_N=block_n)
    return y
