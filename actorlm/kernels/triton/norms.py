"""Triton RMSNorm, alone and fused with the residual add, in HF transformers' rounding order.

Per row, in fp32: ``normed = x * rsqrt(mean(x^2) + eps)``; then Llama's ``LlamaRMSNorm`` rounds
``normed`` to x's dtype before multiplying by ``weight`` (two roundings), while Gemma's
``Gemma3RMSNorm`` (``unit_offset``) multiplies by ``1 + weight`` in fp32 and rounds once. The fused
``add_rms_norm`` first rounds ``x + residual`` to the dtype (the residual stream HF carries) and
normalises that. A [T * heads, D] view serves the per-head q/k norms.

Each program owns ``BLOCK_R`` rows. A row that fits in ``_MAX_BLOCK_H`` stays in registers (one
read, one write; short rows are packed several to a program); a longer one is streamed twice in
``BLOCK_H`` chunks, once for the sum of squares and once to normalise. The oracles are
``rms_norm_ref`` and ``add_rms_norm_ref`` in ``reference.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK_H = 16384  # a row this long still fits in registers (16 warps, 32 fp32 each)
# Elements of a [BLOCK_R, BLOCK_H] tile when short rows share a program: register-sized on a
# GPU; large on the CPU interpreter, whose cost is per operation rather than per element.
_ROWS_TILE_GPU = 2048
_ROWS_TILE_CPU = 65536

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 ``x`` rounded to nearest (ties to even) in ``DTYPE``, as torch rounds.

    bf16 is rounded on the bits: the interpreter truncates fp32 -> bf16 casts, and the rounded
    value converts exactly on either path (four integer ops on a GPU). NaN passes through.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
    return x.to(DTYPE)


@triton.jit
def _load_stream(x_ptr, residual_ptr, rows, cols, mask, stride_x, stride_res,
                 HAS_RESIDUAL: tl.constexpr, STORE_RESIDUAL: tl.constexpr):
    """[BLOCK_R, BLOCK_H] fp32 chunk of the rows to normalise: x, or x + residual rounded once to
    x's dtype (then written back over residual when ``STORE_RESIDUAL``)."""
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual_ptrs = residual_ptr + rows[:, None] * stride_res + cols[None, :]
        residual = tl.load(residual_ptrs, mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + residual.to(tl.float32), x.dtype)
        if STORE_RESIDUAL:
            tl.store(residual_ptrs, x, mask=mask)
    return x.to(tl.float32)


@triton.jit
def _store_normed(out_ptr, weight_ptr, stream, inv_rms, rows, cols, col_mask, mask, stride_out,
                  UNIT_OFFSET: tl.constexpr):
    """out = the chunk ``stream`` [BLOCK_R, BLOCK_H] * ``inv_rms`` [BLOCK_R], scaled as the
    family's norm does."""
    dtype = out_ptr.dtype.element_ty
    weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)  # [BLOCK_H]
    normed = stream * inv_rms[:, None]
    if UNIT_OFFSET:  # Gemma: normed * (1 + w) in fp32, one rounding
        y = normed * (1.0 + weight)[None, :]
    else:  # Llama: normed rounds to the dtype first (the identity for fp32)
        y = weight[None, :] * round_to(normed, dtype).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], round_to(y, dtype), mask=mask)


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [T, H]; may be x itself
    x_ptr,  # [T, H]
    residual_ptr,  # [T, H]; overwritten with round(x + residual) when HAS_RESIDUAL
    weight_ptr,  # [H]
    num_rows,
    hidden,
    stride_out,
    stride_x,
    stride_res,
    eps,
    UNIT_OFFSET: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ONE_CHUNK: tl.constexpr,  # BLOCK_H >= hidden: the rows stay in registers
    BLOCK_R: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # [BLOCK_R]
    row_mask = rows < num_rows
    offs_h = tl.arange(0, BLOCK_H)
    if ONE_CHUNK:
        col_mask = offs_h < hidden
        mask = row_mask[:, None] & col_mask[None, :]  # [BLOCK_R, BLOCK_H]
        stream = _load_stream(x_ptr, residual_ptr, rows, offs_h, mask, stride_x, stride_res,
                              HAS_RESIDUAL, True)
        inv_rms = tl.math.rsqrt(tl.sum(stream * stream, axis=1) / hidden + eps)  # [BLOCK_R]
        _store_normed(out_ptr, weight_ptr, stream, inv_rms, rows, offs_h, col_mask, mask,
                      stride_out, UNIT_OFFSET)
    else:
        sum_sq = tl.zeros([BLOCK_R], dtype=tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            cols = h0 + offs_h
            mask = row_mask[:, None] & (cols < hidden)[None, :]
            stream = _load_stream(x_ptr, residual_ptr, rows, cols, mask, stride_x, stride_res,
                                  HAS_RESIDUAL, False)
            sum_sq += tl.sum(stream * stream, axis=1)
        inv_rms = tl.math.rsqrt(sum_sq / hidden + eps)
        # Each chunk is read (x, residual) before it is written (residual, out): in place is safe.
        for h0 in range(0, hidden, BLOCK_H):
            cols = h0 + offs_h
            col_mask = cols < hidden
            mask = row_mask[:, None] & col_mask[None, :]
            stream = _load_stream(x_ptr, residual_ptr, rows, cols, mask, stride_x, stride_res,
                                  HAS_RESIDUAL, True)
            _store_normed(out_ptr, weight_ptr, stream, inv_rms, rows, cols, col_mask, mask,
                          stride_out, UNIT_OFFSET)


def _check_rows(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    assert t.shape == like.shape and t.dtype == like.dtype and t.device == like.device, \
        f"{name}: {tuple(t.shape)} {t.dtype} {t.device}, want those of x"
    assert t.stride(1) == 1, \
        f"{name}: the hidden dimension must be contiguous, strides {t.stride()}"


def _launch(out, x, residual, weight, eps: float, unit_offset: bool) -> None:
    assert x.dim() == 2 and x.dtype in _FLOAT_DTYPES, (x.shape, x.dtype)
    num_rows, hidden = x.shape
    assert hidden > 0 and weight.shape == (hidden,), (x.shape, weight.shape)
    assert weight.dtype == x.dtype and weight.is_contiguous() and weight.device == x.device, \
        weight.dtype
    _check_rows("x", x, x)
    _check_rows("out", out, x)
    if residual is not None:
        _check_rows("residual", residual, x)
    if num_rows == 0:
        return
    block_h = min(triton.next_power_of_2(hidden), _MAX_BLOCK_H)
    one_chunk = block_h >= hidden
    if one_chunk:  # pack short rows (q/k norms: D per row) into one program
        rows_tile = _ROWS_TILE_GPU if x.device.type == "cuda" else _ROWS_TILE_CPU
        block_r = min(triton.next_power_of_2(num_rows), max(1, rows_tile // block_h))
    else:
        block_r = 1
    res = x if residual is None else residual  # never read without HAS_RESIDUAL
    _rms_norm_kernel[(triton.cdiv(num_rows, block_r),)](
        out, x, res, weight,
        num_rows, hidden, out.stride(0), x.stride(0), res.stride(0), eps,
        UNIT_OFFSET=unit_offset,
        HAS_RESIDUAL=residual is not None,
        ONE_CHUNK=one_chunk,
        BLOCK_R=block_r,
        BLOCK_H=block_h,
        num_warps=max(1, min(16, block_r * block_h // 512)),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row of x [T, H] (stride(1) == 1, any row stride) by weight [H] (x's
    dtype); ``unit_offset`` scales by ``1 + weight`` (Gemma). Writes ``out`` [T, H] (may be x)
    when given. Returns out."""
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(out, x, None, weight, eps, unit_offset)
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded once to the dtype, both written in
    place: the norm over x [T, H], the new residual stream over residual [T, H]. Returns
    (x, residual)."""
    _launch(x, x, residual, weight, eps, unit_offset)
    return x, residual
