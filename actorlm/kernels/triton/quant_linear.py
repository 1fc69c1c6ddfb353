"""Triton linear layers over GGUF-quantized weights, dequantized tile by tile in registers.

A ``QuantizedWeight`` keeps a layer's weight as GGUF stores it: one row of blocks per output
feature, each block its scale fields and packed quants (``gguf/quants.py`` is the layout's
reference). Each program owns a [BLOCK_M, BLOCK_N] tile of the output; per BLOCK_K step it loads
x's tile, dequantizes the weight's [BLOCK_K, BLOCK_N] tile from the raw bytes (one small device
function per format, gathering each element's quant bits and its block's scales) and ``tl.dot``s
the two, accumulating in fp32. The weight is never written out dequantized.

Arithmetic, which the tests' tolerances follow:

- A weight is dequantized in fp32 in gguf's own order of operations (its products of f16 scales
  and small integers are exact; at most one rounding, a Q4_1/K-format minimum's subtraction or
  Q6_K's last product), so it equals ``gguf.quants.dequantize``'s value.
- For 16-bit x the weight is then rounded to x's dtype (to nearest), as the model ran before:
  dequantized once at load and cast to the model's dtype. The products are then exact in fp32
  on either path (tensor cores on a GPU), and every batch size sees the same weights.
- For fp32 x the dot is ``input_precision="ieee"``: exact products, never tf32.
- The bias is added to the fp32 accumulator; the sum is rounded once to x's dtype.

Small batches (decode) take a GEMV-shaped tile (the 16 rows tl.dot needs, narrow in N so that
more programs share the weight's bytes); larger 16-bit ones a 128 x 64 GEMM tile on the tensor
cores. Every element gathers its own quant bits and scale bytes (the cache serves the repeats):
simple and correct, but more load instructions than bytes; loading each block's scales once and
broadcasting them is the next step, to be measured on a GPU.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from actorlm.kernels.backend import QuantizedWeight, no_quantized_kernels
from actorlm.kernels.triton.norms import round_to

# (elements, bytes) per block, as gguf's GGML_QUANT_SIZES: 32-element blocks and 256-element
# superblocks.
BLOCK_FORMATS = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class _Tile(NamedTuple):
    block_m: int
    block_n: int
    block_k: int  # divides 256, so a K-format tile never straddles two superblocks
    num_warps: int
    num_stages: int


# Sized for sm_90 so that no format spills registers (ptxas's count; the per-element
# dequantization's integer temporaries, not the tiles, fill them): not yet tuned on a GPU.
# fp32 x always takes the small tile: the ieee dot keeps its operands in registers.
_GEMV_MAX_M = 16
_GEMV_TILE = _Tile(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=2)
_GEMM_TILE = _Tile(block_m=128, block_n=64, block_k=32, num_warps=8, num_stages=3)
# The CPU interpreter's cost is per operation, not per element: fewer, larger tiles.
_CPU_GEMV_TILE = _Tile(block_m=16, block_n=32, block_k=128, num_warps=1, num_stages=1)
_CPU_GEMM_TILE = _Tile(block_m=64, block_n=64, block_k=64, num_warps=1, num_stages=1)


# --- reading the bytes ------------------------------------------------------------------------


@triton.jit
def _byte(ptr, mask):
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def _signed_byte(ptr, mask):
    return (_byte(ptr, mask) ^ 0x80) - 0x80  # two's complement int8, widened


@triton.jit
def _f16(ptr, mask):
    """The little-endian f16 field at ``ptr`` (blocks are byte-aligned: two loads), in fp32."""
    bits = _byte(ptr, mask) | (_byte(ptr + 1, mask) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble(ptr, high, mask):
    """The low (``high`` 0) or high (1) four bits of the byte at ``ptr``."""
    return (_byte(ptr, mask) >> (high * 4)) & 0xF


# --- one function per format: (row pointers, element index k, mask) -> the weight in fp32 ------
# ``row`` [1, BLOCK_N] points at each output row's first block, ``k`` [BLOCK_K, 1] is the input
# index; the result broadcasts to [BLOCK_K, BLOCK_N]. The expressions keep gguf's order.


@triton.jit
def _q4_0(row, k, mask):
    block, i = row + (k // 32) * 18, k % 32  # d: f16, qs[16]: element i in nibble i // 16
    q = _nibble(block + 2 + i % 16, i // 16, mask)
    return _f16(block, mask) * (q - 8).to(tl.float32)


@triton.jit
def _q4_1(row, k, mask):
    block, i = row + (k // 32) * 20, k % 32  # d, m: f16, qs[16]
    q = _nibble(block + 4 + i % 16, i // 16, mask)
    return _f16(block, mask) * q.to(tl.float32) + _f16(block + 2, mask)


@triton.jit
def _q5_0(row, k, mask):
    block, i = row + (k // 32) * 22, k % 32  # d: f16, qh: 32 high bits (LE u32), qs[16]
    high = (_byte(block + 2 + i // 8, mask) >> (i % 8)) & 1
    q = _nibble(block + 6 + i % 16, i // 16, mask) | (high << 4)
    return _f16(block, mask) * (q - 16).to(tl.float32)


@triton.jit
def _q8_0(row, k, mask):
    block, i = row + (k // 32) * 34, k % 32  # d: f16, qs[32]: int8
    return _signed_byte(block + 2 + i, mask).to(tl.float32) * _f16(block, mask)


@triton.jit
def _k_scale_min(scales, s, mask):
    """Sub-block ``s``'s 6-bit scale and min from a Q4_K/Q5_K superblock's 12 packed bytes:
    s < 4 in the low six bits of bytes s and s + 4; s >= 4 in the nibbles of byte s + 4, topped
    with the two spare high bits of bytes s - 4 and s."""
    j = s % 4
    a, b, c = _byte(scales + j, mask), _byte(scales + j + 4, mask), _byte(scales + j + 8, mask)
    low = s < 4
    scale = tl.where(low, a & 63, (c & 0xF) | ((a >> 6) << 4))
    minimum = tl.where(low, b & 63, (c >> 4) | ((b >> 6) << 4))
    return scale.to(tl.float32), minimum.to(tl.float32)


@triton.jit
def _k_value(block, s, q, mask):
    """A Q4_K/Q5_K value from its quant q in sub-block s: d * scale * q - dmin * min."""
    scale, minimum = _k_scale_min(block + 4, s, mask)
    return (_f16(block, mask) * scale) * q - _f16(block + 2, mask) * minimum


@triton.jit
def _q4_k(row, k, mask):
    # d, dmin: f16, scales[12], qs[128]: sub-block s (32 elements) in nibble s % 2 of
    # bytes 32 (s // 2) ...
    block, i = row + (k // 256) * 144, k % 256
    s, j = i // 32, i % 32
    q = _nibble(block + 16 + (s // 2) * 32 + j, s % 2, mask).to(tl.float32)
    return _k_value(block, s, q, mask)


@triton.jit
def _q5_k(row, k, mask):
    # d, dmin: f16, scales[12], qh[32]: bit s of byte j is element j of sub-block s's 5th bit,
    # qs[128] as Q4_K's
    block, i = row + (k // 256) * 176, k % 256
    s, j = i // 32, i % 32
    high = (_byte(block + 16 + j, mask) >> s) & 1
    q = (_nibble(block + 48 + (s // 2) * 32 + j, s % 2, mask) | (high << 4)).to(tl.float32)
    return _k_value(block, s, q, mask)


@triton.jit
def _q6_k(row, k, mask):
    # ql[128], qh[64], scales[16]: int8, one per 16 elements, d: f16. Each half of 128 elements
    # takes 64 ql bytes (low nibbles, then high) and 32 qh bytes (bit pairs 0-1, ..., 6-7).
    block, i = row + (k // 256) * 210, k % 256
    half, r = i // 128, i % 128
    low = _nibble(block + half * 64 + r % 64, r // 64, mask)
    high = (_byte(block + 128 + half * 32 + r % 32, mask) >> ((r // 32) * 2)) & 3
    q = ((low | (high << 4)) - 32).to(tl.float32)
    scale = _signed_byte(block + 192 + i // 16, mask).to(tl.float32)
    return (_f16(block + 208, mask) * scale) * q


@triton.jit
def _dequantize(row, k, mask, FORMAT: tl.constexpr):
    if FORMAT == "Q4_0":
        w = _q4_0(row, k, mask)
    elif FORMAT == "Q4_1":
        w = _q4_1(row, k, mask)
    elif FORMAT == "Q5_0":
        w = _q5_0(row, k, mask)
    elif FORMAT == "Q8_0":
        w = _q8_0(row, k, mask)
    elif FORMAT == "Q4_K":
        w = _q4_k(row, k, mask)
    elif FORMAT == "Q5_K":
        w = _q5_k(row, k, mask)
    else:
        tl.static_assert(FORMAT == "Q6_K")
        w = _q6_k(row, k, mask)
    return w


# --- the kernel -------------------------------------------------------------------------------


@triton.jit
def _quant_linear_kernel(
    out_ptr,  # [M, N], x's dtype
    x_ptr,  # [M, K]
    w_ptr,  # [N, row_bytes] uint8: the GGUF blocks
    bias_ptr,  # [N]; read when HAS_BIAS
    M,
    N,
    K,
    stride_out,
    stride_x,
    stride_w,  # row_bytes
    FORMAT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,  # bf16 on the CPU interpreter, which multiplies bf16 as raw bits
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    dtype = out_ptr.dtype.element_ty
    offs_m = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # [BLOCK_M]
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_mask, n_mask = offs_m < M, offs_n < N
    rows = w_ptr + offs_n.to(tl.int64)[None, :] * stride_w  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]; K is whole blocks, a tile may pass its end
        k_mask = k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_x + k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        w = _dequantize(rows, k[:, None], k_mask[:, None] & n_mask[None, :], FORMAT)
        if x.dtype == tl.float32:
            acc = tl.dot(x, w, acc, input_precision="ieee")  # [BLOCK_K, BLOCK_N] w
        else:
            w = round_to(w, x.dtype)  # as the dequantized weight cast to the model's dtype
            if DOT_IN_FP32:
                acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_out + offs_n[None, :]
    tl.store(out_ptrs, round_to(acc, dtype), mask=m_mask[:, None] & n_mask[None, :])


# --- launchers --------------------------------------------------------------------------------


def block_rows(weight: QuantizedWeight) -> torch.Tensor:
    """``weight.blocks`` as [rows, row_bytes] (checking that they encode ``weight.shape``);
    the error names the format when this wing has no kernel for it."""
    if weight.type_name not in BLOCK_FORMATS:
        raise no_quantized_kernels(weight, "triton")
    rows, in_features = weight.shape
    block_elements, block_bytes = BLOCK_FORMATS[weight.type_name]
    assert in_features % block_elements == 0, \
        f"{weight.type_name}: in_features {in_features} is not whole {block_elements}-blocks"
    row_bytes = in_features // block_elements * block_bytes
    blocks = weight.blocks
    assert blocks.dtype == torch.uint8 and blocks.numel() == rows * row_bytes, \
        (f"{weight.type_name} {weight.shape}: want {rows} x {row_bytes} uint8 bytes, got "
         f"{tuple(blocks.shape)} {blocks.dtype}")
    return blocks.reshape(rows, row_bytes)


def _tile(num_rows: int, dtype: torch.dtype, device: torch.device) -> _Tile:
    if device.type != "cuda":
        return _CPU_GEMV_TILE if num_rows <= _GEMV_MAX_M else _CPU_GEMM_TILE
    if num_rows <= _GEMV_MAX_M or dtype == torch.float32:
        return _GEMV_TILE
    return _GEMM_TILE


def _launch(out, x, blocks, type_name: str, bias) -> None:
    """out [M, n] (a column slice) = x [M, K] @ dequantize(blocks [n, row_bytes]).T + bias."""
    num_rows, in_features = x.shape
    num_out = blocks.shape[0]
    assert blocks.stride(1) == 1, f"blocks: rows must be contiguous, strides {blocks.stride()}"
    if bias is not None:
        assert bias.shape == (num_out,) and bias.device == x.device, (bias.shape, bias.device)
        assert bias.stride(0) == 1 and bias.dtype in _FLOAT_DTYPES, (bias.stride(), bias.dtype)
    tile = _tile(num_rows, x.dtype, x.device)
    block_m = max(16, min(tile.block_m, triton.next_power_of_2(num_rows)))  # tl.dot: >= 16
    block_k = min(tile.block_k, triton.next_power_of_2(in_features))
    grid = (triton.cdiv(num_out, tile.block_n), triton.cdiv(num_rows, block_m))
    _quant_linear_kernel[grid](
        out, x, blocks, x if bias is None else bias,
        num_rows, num_out, in_features, out.stride(0), x.stride(0), blocks.stride(0),
        FORMAT=type_name,
        HAS_BIAS=bias is not None,
        DOT_IN_FP32=x.dtype == torch.bfloat16 and x.device.type != "cuda",
        BLOCK_M=block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=block_k,
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
    )


def quant_linear(x: torch.Tensor, parts: QuantizedWeight | Sequence[QuantizedWeight],
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (fp32/bf16/fp16, stride(1) == 1) @ W.T + bias -> [M, N] in x's dtype, where W
    [N, K] is ``parts`` (GGUF-quantized weights on x's device, each [n_i, K], of any formats in
    ``BLOCK_FORMATS``) stacked row-wise, and bias [N] (any float dtype) or None. One launch per
    part."""
    parts = [parts] if isinstance(parts, QuantizedWeight) else list(parts)
    assert x.dim() == 2 and x.dtype in _FLOAT_DTYPES, (x.shape, x.dtype)
    assert x.stride(1) == 1, f"x: rows must be contiguous, strides {x.stride()}"
    num_rows, in_features = x.shape
    for part in parts:
        assert part.shape[1] == in_features, \
            f"{part.type_name} part {part.shape}: in_features must be x's {in_features}"
        assert part.blocks.device == x.device, (part.blocks.device, x.device)
    num_out = sum(part.shape[0] for part in parts)
    assert bias is None or bias.shape == (num_out,), (bias.shape, num_out)
    out = torch.empty((num_rows, num_out), dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    start = 0
    for part in parts:
        stop = start + part.shape[0]
        if stop > start:
            _launch(out[:, start:stop], x, block_rows(part), part.type_name,
                    None if bias is None else bias[start:stop])
        start = stop
    return out


class TritonQuantLinear:
    """``x [..., K] -> x @ W.T + bias`` for a layer whose weight is ``parts`` (GGUF-quantized,
    stacked row-wise: a fused qkv or gate_up may mix formats), built once at load. It keeps the
    blocks on ``device``, parts of one format next to each other merged into one tensor so that
    they take one launch."""

    def __init__(self, parts: QuantizedWeight | Sequence[QuantizedWeight],
                 bias: torch.Tensor | None, device: torch.device | str):
        parts = [parts] if isinstance(parts, QuantizedWeight) else list(parts)
        assert parts, "a layer needs at least one part"
        runs: list[list[QuantizedWeight]] = []
        self.in_features = parts[0].shape[1]
        for part in parts:
            block_rows(part)  # refuses unknown formats and bad shapes here, at load
            assert part.shape[1] == self.in_features, \
                f"parts of one layer share in_features: {[p.shape for p in parts]}"
            if runs and runs[-1][0].type_name == part.type_name:
                runs[-1].append(part)
            else:
                runs.append([part])
        self.parts = [self._merged(run, device) for run in runs]
        self.out_features = sum(part.shape[0] for part in self.parts)
        self.bias = None if bias is None else bias.detach().to(device).contiguous()

    @staticmethod
    def _merged(run: list[QuantizedWeight], device) -> QuantizedWeight:
        blocks = [block_rows(part).detach().to(device) for part in run]
        blocks = blocks[0].contiguous() if len(blocks) == 1 else torch.cat(blocks)
        rows = sum(part.shape[0] for part in run)
        return QuantizedWeight(run[0].type_name, blocks, (rows, run[0].shape[1]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.stride(1) != 1:
            flat = flat.contiguous()
        out = quant_linear(flat, self.parts, self.bias)  # [T, N]
        return out.view(*x.shape[:-1], self.out_features)
