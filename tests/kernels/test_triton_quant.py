"""quant_linear (Triton, interpreted on the CPU) against gguf's own dequantization.

The oracle is ``gguf.quants.dequantize(blocks)`` in float64, times x in float64, plus the bias:
it shares no code with the kernel. Q4_0, Q4_1, Q5_0 and Q8_0 weights come from
``gguf.quants.quantize``; gguf cannot quantize the K formats, so their blocks are random bytes
with sane f16 scale fields (every bit pattern of the quants and packed scales is valid).

The bound follows the kernel's arithmetic (see ``quant_linear.py``), per output element over its
K terms |w_k x_k|:

- the weight: the kernel's fp32 dequantization and gguf's each lie within one rounding, u32 |w|,
  of the exact value (they agree bit for bit here: test_identity_reads_every_weight_exactly);
  for 16-bit x the kernel rounds it once more to x's dtype, u_x |w|;
- the products are then exact in fp32 (fp32 x: ``input_precision="ieee"``, no tf32 on a GPU;
  16-bit x: 16-bit times 16-bit), and the K of them and the bias are summed in fp32 in the
  tiles' order: ``tolerance.sum_error`` over K + 1 terms;
- the sum is rounded once to x's dtype.
"""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES

from actorlm.kernels.backend import QuantizedWeight
from actorlm.kernels.triton import quant_linear as quant_linear_module
from actorlm.kernels.triton.quant_linear import BLOCK_FORMATS, TritonQuantLinear, quant_linear
from tolerance import assert_within, linear_error, unit_roundoff

FORMATS = list(BLOCK_FORMATS)
K_FORMATS = [name for name in FORMATS if name.endswith("_K")]
DTYPES = [torch.float32, torch.bfloat16]
U32 = unit_roundoff(torch.float32)
DEVICE = torch.empty(0).device  # the CPU, or ACTORLM_TEST_DEVICE's GPU (tests/kernels/conftest)
# Byte offset of each format's f16 scale d within a block.
D_OFFSET = {name: 208 if name == "Q6_K" else 0 for name in FORMATS}


def _block_shape(type_name):
    return BLOCK_FORMATS[type_name]


def _random_blocks(type_name, rows, in_features, rng):
    """[rows, K / block, block bytes] uint8: quantized by gguf where it can, else random bytes
    with the f16 d (and dmin) set to values of either sign that keep the weights near unit
    size."""
    block_elements, block_bytes = _block_shape(type_name)
    num_blocks = in_features // block_elements
    if type_name not in K_FORMATS:
        weight = rng.standard_normal((rows, in_features)).astype(np.float32)
        blocks = gguf.quants.quantize(weight, gguf.GGMLQuantizationType[type_name])
        return blocks.reshape(rows, num_blocks, block_bytes)
    blocks = rng.integers(0, 256, (rows, num_blocks, block_bytes), dtype=np.uint8)
    # |scale * q| reaches 63 * 31 (Q5_K) or 128 * 32 (Q6_K); d ~ 2^-10 keeps |w| within a few.
    fields = [D_OFFSET[type_name]] + ([] if type_name == "Q6_K" else [2])  # d, dmin
    for offset in fields:
        value = rng.uniform(2.0**-11, 2.0**-9, (rows, num_blocks))
        value = (value * rng.choice([-1.0, 1.0], value.shape)).astype(np.float16)
        blocks[..., offset:offset + 2] = value.view(np.uint8).reshape(rows, num_blocks, 2)
    return blocks


def _weight(blocks: np.ndarray, type_name: str) -> QuantizedWeight:
    rows, num_blocks, _ = blocks.shape
    in_features = num_blocks * _block_shape(type_name)[0]
    return QuantizedWeight(type_name, torch.from_numpy(blocks.reshape(rows, -1)).to(DEVICE),
                           (rows, in_features))


def _dequantized(blocks: np.ndarray, type_name: str) -> torch.Tensor:
    """gguf's float32 dequantization [rows, K], in float64."""
    rows = blocks.shape[0]
    values = gguf.quants.dequantize(blocks.reshape(rows, -1), gguf.GGMLQuantizationType[type_name])
    return torch.from_numpy(values).double().to(DEVICE)


def _inputs(num_rows, in_features, dtype, rng, extra=3):
    """x [M, K] in dtype, a column slice of a wider tensor (rows not contiguous with each
    other)."""
    wide = torch.from_numpy(rng.standard_normal((num_rows, in_features + extra)))
    return wide.to(dtype).to(DEVICE)[:, extra:]


def _expected(x, weight, bias):
    out = x.double() @ weight.T  # [M, N]
    return out if bias is None else out + bias.double()


def _bound(x, weight, bias, expected):
    """The kernel's error from the float64 oracle (the module docstring's three terms)."""
    dtype = x.dtype
    accumulation = linear_error(x, weight, bias, expected, torch.float32, output=dtype)
    weight_rounding = 2 * U32 + (0.0 if dtype == torch.float32 else unit_roundoff(dtype))
    return accumulation + weight_rounding * (x.double().abs() @ weight.abs().T)


def _one_block_or_two(type_name):
    """in_features of two 32-element blocks, or of one superblock (8 sub-blocks) in a K format:
    small for the interpreter; more blocks in test_matches_gguf_oracle."""
    block_elements = _block_shape(type_name)[0]
    return block_elements if type_name in K_FORMATS else 2 * block_elements


def _dtype_id(value):
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def test_block_formats_are_gguf_s():
    for name, sizes in BLOCK_FORMATS.items():
        assert GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]] == sizes, name


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=_dtype_id)
@pytest.mark.parametrize("type_name", FORMATS)
def test_identity_reads_every_weight_exactly(type_name, dtype):
    # x = I: each output is one product w * 1 plus zeros, exact, so y = W.T bit for bit (rounded
    # to nearest in x's dtype for 16-bit x). The whole eye takes the GEMM tile; its first and
    # last 16 rows, the GEMV tile.
    rng = np.random.default_rng(FORMATS.index(type_name))
    in_features = _one_block_or_two(type_name)
    blocks = _random_blocks(type_name, 20, in_features, rng)
    weight = _weight(blocks, type_name)
    expected = _dequantized(blocks, type_name).float().to(dtype).T  # [K, N]
    eye = torch.eye(in_features, dtype=dtype, device=DEVICE)
    assert torch.equal(quant_linear(eye, [weight]), expected)
    for rows in (slice(0, 16), slice(in_features - 16, in_features)):
        assert torch.equal(quant_linear(eye[rows], weight), expected[rows])


CASES = [(1, True), (2, False), (7, True), (33, False)]  # (M, has_bias): GEMV to GEMM tiles


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("num_blocks", [1, 3])
@pytest.mark.parametrize("num_rows, has_bias", CASES)
@pytest.mark.parametrize("type_name", FORMATS)
def test_matches_gguf_oracle(type_name, num_rows, has_bias, num_blocks, dtype):
    # N = 40: no multiple of either tile's width (32, 64); K = 3 blocks is ragged in BLOCK_K.
    rng = np.random.default_rng([FORMATS.index(type_name), num_rows, num_blocks])
    in_features = num_blocks * _block_shape(type_name)[0]
    blocks = _random_blocks(type_name, 40, in_features, rng)
    x = _inputs(num_rows, in_features, dtype, rng)
    bias = torch.from_numpy(rng.standard_normal(40)).to(dtype).to(DEVICE) if has_bias else None
    out = quant_linear(x, [_weight(blocks, type_name)], bias)
    assert out.shape == (num_rows, 40) and out.dtype == dtype
    weight = _dequantized(blocks, type_name)
    expected = _expected(x, weight, bias)
    assert_within(out, expected, _bound(x, weight, bias, expected),
                  f"{type_name} {dtype} M={num_rows} K={in_features}")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("num_rows", [2, 33])
@pytest.mark.parametrize("type_name", ["Q5_0", "Q4_K"])
def test_gpu_tiles(monkeypatch, type_name, num_rows, dtype):
    # The interpreter takes larger tiles than a GPU; the GPU's (BLOCK_K 32: a sub-block a step,
    # the 128-row GEMM tile) run here too.
    device = torch.device("cuda")
    monkeypatch.setattr(quant_linear_module, "_CPU_GEMV_TILE",
                        quant_linear_module._tile(num_rows, dtype, device))
    monkeypatch.setattr(quant_linear_module, "_CPU_GEMM_TILE",
                        quant_linear_module._tile(num_rows, dtype, device))
    rng = np.random.default_rng([FORMATS.index(type_name), num_rows])
    in_features = _one_block_or_two(type_name)
    blocks = _random_blocks(type_name, 40, in_features, rng)
    x = _inputs(num_rows, in_features, dtype, rng)
    bias = torch.from_numpy(rng.standard_normal(40)).to(dtype).to(DEVICE)
    weight = _dequantized(blocks, type_name)
    expected = _expected(x, weight, bias)
    assert_within(quant_linear(x, _weight(blocks, type_name), bias), expected,
                  _bound(x, weight, bias, expected), f"{type_name} {dtype} M={num_rows}")


MIXED_PARTS = [("Q4_K", 24), ("Q4_K", 8), ("Q6_K", 9), ("Q8_0", 17)]  # a Q4_K_M-like qkv


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("num_tokens", [3, 20])
def test_layer_of_mixed_formats(num_tokens, dtype):
    rng = np.random.default_rng(num_tokens)
    in_features = 256
    all_blocks = [_random_blocks(name, rows, in_features, rng) for name, rows in MIXED_PARTS]
    parts = [_weight(blocks, name) for blocks, (name, _) in zip(all_blocks, MIXED_PARTS)]
    weight = torch.cat([_dequantized(b, name) for b, (name, _) in zip(all_blocks, MIXED_PARTS)])
    bias = torch.from_numpy(rng.standard_normal(weight.shape[0])).to(dtype).to(DEVICE)
    layer = TritonQuantLinear(parts, bias, DEVICE)
    # The two Q4_K parts share one launch.
    assert [(p.type_name, p.shape) for p in layer.parts] == [
        ("Q4_K", (32, 256)), ("Q6_K", (9, 256)), ("Q8_0", (17, 256))]
    x = _inputs(num_tokens, in_features, dtype, rng)
    expected = _expected(x, weight, bias)
    bound = _bound(x, weight, bias, expected)
    assert_within(quant_linear(x, parts, bias), expected, bound, f"parts {dtype}")
    # The layer takes x [..., K] (here [T, 1, K]) as the model hands it over.
    out = layer(x[:, None])
    assert out.shape == (num_tokens, 1, weight.shape[0]) and out.dtype == dtype
    assert_within(out[:, 0], expected, bound, f"layer {dtype}")


# --- the bound is tight enough to fail a wrong kernel -------------------------------------------


def _swap_nibbles(span):
    def bug(blocks):
        quants = blocks[..., span[0]:span[1]]
        blocks[..., span[0]:span[1]] = (quants >> 4) | (quants << 4)
    return bug


def _d_big_endian(type_name):
    offset = D_OFFSET[type_name]

    def bug(blocks):
        blocks[..., offset:offset + 2] = blocks[..., offset:offset + 2][..., ::-1].copy()
    return bug


def _d_of_next_block(type_name):
    offset = D_OFFSET[type_name]

    def bug(blocks):
        blocks[..., offset:offset + 2] = np.roll(blocks[..., offset:offset + 2], -1, axis=1)
    return bug


def _zeroed(span):
    def bug(blocks):
        blocks[..., span[0]:span[1]] = 0
    return bug


def _k_scales_without_high_bits(blocks):  # the s >= 4 scales' and mins' top two bits lost
    blocks[..., 4:12] &= 0x3F


def _q6_k_scale_per_32(blocks):  # one scale per 32 elements instead of 16
    blocks[..., 193:208:2] = blocks[..., 192:208:2]


# (format, what the wrong kernel does, the same bug as the bytes it would have to read)
WRONG_KERNELS = [
    *[(name, "d read big-endian", _d_big_endian(name)) for name in FORMATS],
    *[(name, "the next block's d", _d_of_next_block(name)) for name in FORMATS],
    *[(name, "nibbles swapped", _swap_nibbles(span)) for name, span in [
        ("Q4_0", (2, 18)), ("Q4_1", (4, 20)), ("Q5_0", (6, 22)), ("Q4_K", (16, 144)),
        ("Q5_K", (48, 176)), ("Q6_K", (0, 128))]],
    *[(name, "high bits dropped", _zeroed(span)) for name, span in [
        ("Q5_0", (2, 6)), ("Q5_K", (16, 48)), ("Q6_K", (128, 192))]],
    *[(name, "min ignored", _zeroed(span)) for name, span in [
        ("Q4_1", (2, 4)), ("Q4_K", (2, 4)), ("Q5_K", (2, 4))]],
    ("Q4_K", "6-bit scales' high bits dropped", _k_scales_without_high_bits),
    ("Q5_K", "6-bit scales' high bits dropped", _k_scales_without_high_bits),
    ("Q6_K", "one scale per 32", _q6_k_scale_per_32),
]


@functools.lru_cache(maxsize=None)
def _right_kernel_case(type_name):
    """(blocks, x, oracle, bound) of a case the right kernel passes: M = 7, K = two blocks, in
    bf16 x, whose bound (the rounding of the weights to bf16) is the loosest."""
    rng = np.random.default_rng(FORMATS.index(type_name))
    blocks = _random_blocks(type_name, 40, 2 * _block_shape(type_name)[0], rng)
    x = _inputs(7, blocks.shape[1] * _block_shape(type_name)[0], torch.bfloat16, rng)
    weight = _dequantized(blocks, type_name)
    expected = _expected(x, weight, None)
    bound = _bound(x, weight, None, expected)
    assert_within(quant_linear(x, _weight(blocks, type_name)), expected, bound, "right kernel")
    return blocks, x, expected, bound


# A d read big-endian may be inf or NaN (inf * 0 in the interpreter's numpy warns).
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("type_name, bug_name, bug", WRONG_KERNELS,
                         ids=[f"{name}-{bug_name}" for name, bug_name, _ in WRONG_KERNELS])
def test_bound_fails_a_wrong_kernel(type_name, bug_name, bug):
    # A kernel with the bug computes what the right one does from bytes with the bug applied;
    # its output must fall outside the bound around the oracle.
    blocks, x, expected, bound = _right_kernel_case(type_name)
    wrong_blocks = blocks.copy()
    bug(wrong_blocks)
    assert not np.array_equal(wrong_blocks, blocks), "the bug changes nothing here"
    wrong = quant_linear(x, _weight(wrong_blocks, type_name))
    with pytest.raises(AssertionError, match="past their bound"):
        assert_within(wrong, expected, bound, f"{bug_name} kernel")


# --- edges ----------------------------------------------------------------------------------------


def test_zero_rows_launch_nothing(monkeypatch):
    monkeypatch.setattr(quant_linear_module, "_quant_linear_kernel", None)  # a launch would fail
    blocks = _random_blocks("Q8_0", 5, 64, np.random.default_rng(0))
    out = quant_linear(torch.empty(0, 64, device=DEVICE), _weight(blocks, "Q8_0"))
    assert out.shape == (0, 5)


def test_formats_without_a_kernel_are_refused_by_name_at_load():
    weight = QuantizedWeight("Q2_K", torch.zeros(1, 84, dtype=torch.uint8), (1, 256))
    with pytest.raises(NotImplementedError, match="Q2_K"):
        TritonQuantLinear([weight], None, DEVICE)


def test_blocks_that_do_not_encode_the_shape_are_refused():
    weight = QuantizedWeight("Q4_0", torch.zeros(1, 17, dtype=torch.uint8), (1, 32))
    with pytest.raises(AssertionError, match="Q4_0"):
        TritonQuantLinear(weight, None, DEVICE)
