"""The quantized linear kernels (``kernels/cpu/quant.py``, ``csrc/quant.cpp``) against a float64
oracle: gguf.quants' own dequantize of the blocks, times x.

What a kernel computes, and so the tolerance: x is quantized per block (32 values for the
32-value formats, 256 for the K formats) to d_x round(x / d_x), d_x = max |x_block| / 127, so
each value moves by at most d_x / 2; the weights' integers are dotted with x's exactly (int32)
and the per-block results scaled and summed in fp32; the sum plus the bias is rounded once to
x's dtype. Two bounds per element of y, both asserted:

- against dequant(W) @ x + b (the layer's true value): sum_k |w_k| d_x(k) (1/2 + 130 u) for x's
  quantization (130 u: fp32's rounding of x / d_x and of d_x itself), plus fp32's
  accumulation, ``tolerance.sum_error`` over the blocks' terms (each rounded a few times: the
  scale product, the int32 -> fp32, the fused add, the lanes' final sum: blocks + 24
  roundings) of sum_k |w_k| |x_k| + |b|, plus the output's rounding to bf16.
- against dequant(W) @ x_q + b, x_q the oracle's own quantization of x (``gguf_blocks``): the
  same without the 1/2 (a value whose x / d_x lies within 1e-4 of a half-integer may round
  either way: a full d_x for those). This one is tight enough to catch a wrong nibble, scale
  or sub-block (``test_the_bound_tells_a_wrong_kernel``).

|w_k| is the sum of magnitudes of the parts the kernel computes apart (d q and the min of
Q4_1 and the K formats).

From ``QuantLinear.panel_from_rows`` rows of x on (where AVX-512 is there) the kernel runs its
other path, dequantized weight panels times x in a dense tile: x is not quantized, the weight
is exact in fp32 and rounded once to bf16 for bf16 x (u_bf16 |w|), and k exact products are
summed in fp32; its bound (``_panel_bound``) is that rounding carried through |x| plus fp32's
accumulation plus the output's rounding. On a CPU with AMX tiles, bf16 x of many rows takes
the weight dequantized whole through torch's GEMM: the same bound, plus the bias's rounding to
bf16 (oneDNN adds a bias of x's dtype). Every ISA path the machine has runs, forced by
``set_isa``; each path runs at every number of rows, forced by ``set_panel_from_rows``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from actorlm.kernels.cpu import linear as cpu_linear
from actorlm.kernels.cpu import native, quant
import gguf_blocks as gb
from tolerance import assert_within, rounding_error, sum_error, unit_roundoff

pytestmark = pytest.mark.skipif(native.library() is None, reason="needs the C++ CPU kernels")

_FLAGS = {"vnni": "avx512_vnni", "avx2": "avx2", "scalar": None}


def _cpu_flags() -> set[str]:
    with open("/proc/cpuinfo") as f:
        return set(next((line for line in f if line.startswith("flags")), "").split())


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


@pytest.fixture(params=list(_FLAGS))
def isa(request):
    """Each ISA path in turn; the default restored after."""
    flag = _FLAGS[request.param]
    if flag is not None and flag not in _cpu_flags():
        pytest.skip(f"CPU lacks {flag}")
    default = quant.isa()
    try:
        quant.set_isa(request.param)
    except ValueError:  # the compiler's flags left it out
        pytest.skip(f"this build lacks {request.param} (the CPU has it)")
    yield request.param
    quant.set_isa(default)


def _bounds(parts, x, bias, out_dtype):
    """(true value, its bound, value with the oracle's x_q, its bound), float64 [M, N]."""
    x64 = x.double()
    exact, quantized, loose, tight = [], [], [], []
    for type_name, blocks in parts:
        weight, magnitude = gb.dequantized(type_name, blocks), gb.magnitudes(type_name, blocks)
        values = gb.block_values(type_name)
        x_q, d, near_tie = gb.quantize_x(x64, values)
        u = unit_roundoff(torch.float32)
        accumulation = sum_error(x.shape[1] // values + 24, (x64.abs() + d) @ magnitude.T)
        exact.append(x64 @ weight.T)
        quantized.append(x_q @ weight.T)
        loose.append((d * (0.5 + 130 * u)) @ magnitude.T + accumulation)
        tight.append((d * (near_tie.double() + 130 * u)) @ magnitude.T + accumulation)
    exact, quantized = torch.cat(exact, 1), torch.cat(quantized, 1)
    loose, tight = torch.cat(loose, 1), torch.cat(tight, 1)
    if bias is not None:
        exact, quantized = exact + bias.double(), quantized + bias.double()
        loose = loose + sum_error(x.shape[1], bias.double().abs())
        tight = tight + sum_error(x.shape[1], bias.double().abs())
    if out_dtype != torch.float32:
        loose, tight = loose + rounding_error(exact, out_dtype), tight + rounding_error(
            quantized, out_dtype)
    return exact, loose, quantized, tight


def _panel_bound(parts, x, bias, out_dtype, bias_rounded=False):
    """(true value, bound) of the many-row path: x as it is against the dequantized weight,
    exact in fp32 (bf16: rounded once to bf16, u_bf16 |w|), k products summed in fp32; with
    ``bias_rounded``, the bias first rounded to ``out_dtype``."""
    x64 = x.double()
    weight = torch.cat([gb.dequantized(t, b) for t, b in parts])
    exact = x64 @ weight.T
    abs_sum = x64.abs() @ weight.abs().T
    bound = sum_error(x.shape[1] + 2, abs_sum)
    if bias is not None:
        exact, bound = exact + bias.double(), bound + sum_error(x.shape[1] + 2, bias.double().abs())
        if bias_rounded:
            bound = bound + unit_roundoff(out_dtype) * bias.double().abs()
    if out_dtype != torch.float32:
        bound = bound + unit_roundoff(out_dtype) * abs_sum + rounding_error(exact, out_dtype)
    return exact, bound


def _check(layer, parts, x, bias, what):
    y = layer(x)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], layer.out_features)
    rows = x.reshape(-1, x.shape[-1])
    y = y.reshape(rows.shape[0], -1)
    panel_from = layer.panel_from_rows(x.dtype)
    if panel_from is not None and rows.shape[0] >= panel_from:
        amx_from = quant._amx_from_rows(x.dtype)
        exact, bound = _panel_bound(parts, rows, bias, x.dtype,
                                    amx_from is not None and rows.shape[0] >= amx_from)
        assert_within(y, exact, bound, f"{what}, panels, against dequant(W) @ x")
        return
    exact, loose, quantized, tight = _bounds(parts, rows, bias, x.dtype)
    assert_within(y, exact, loose, f"{what}, against dequant(W) @ x")
    assert_within(y, quantized, tight, f"{what}, against dequant(W) @ x_q")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("type_name", quant.KEPT_TYPES)
def test_a_layer_of_each_type_against_the_oracle(isa, type_name, dtype):
    rng = np.random.default_rng(list(quant.KEPT_TYPES).index(type_name))
    values = gb.block_values(type_name)
    for num_blocks in (1, 3):  # one block, and an odd count (a last pair half empty)
        k, n = values * num_blocks, 37  # n: no multiple of any tiling
        blocks = gb.random_blocks(type_name, n, k, rng)
        for m in (1, 2, 7, 64):
            bias = torch.randn(n) if m % 2 == 0 else None
            layer = quant.QuantLinear([gb.quantized_weight(type_name, blocks, k)], bias)
            x = torch.randn(m, k + 5).to(dtype)[:, 3:3 + k]  # rows k + 5 apart
            _check(layer, [(type_name, blocks)], x, bias, f"{isa} {type_name} k={k} m={m}")


def test_a_layer_of_parts_in_mixed_types(isa):
    rng = np.random.default_rng(7)
    k = 512
    parts = [(t, gb.random_blocks(t, rows, k, rng))
             for t, rows in (("Q4_0", 70), ("Q6_K", 9), ("Q8_0", 3), ("Q4_K", 5))]
    bias = torch.randn(sum(b.shape[0] for _, b in parts))
    layer = quant.QuantLinear([gb.quantized_weight(t, b, k) for t, b in parts], bias)
    for dtype in (torch.float32, torch.bfloat16):
        for m in (1, 5, 64):
            x = torch.randn(2, m, k).to(dtype)  # [..., in] as F.linear takes it
            _check(layer, parts, x, bias, f"{isa} mixed m={m} {dtype}")


@pytest.fixture
def panel_from_rows():
    """Set the many-row path's threshold; the default restored after."""
    probe = quant.QuantLinear([gb.quantized_weight(
        "Q8_0", gb.random_blocks("Q8_0", 1, 32, np.random.default_rng(0)), 32)], None)
    if probe.panel_from_rows(torch.float32) is None:
        pytest.skip("no panel path: it needs avx512f, in the CPU and in the build")
    yield quant.set_panel_from_rows
    quant.set_panel_from_rows(None)


@pytest.mark.parametrize("type_name", quant.KEPT_TYPES)
def test_each_path_at_any_number_of_rows(type_name, panel_from_rows):
    """The integer path at many rows, the panel path at few (where it runs at all); bf16
    panels on the AMX tiles and on the AVX-512 tile where the CPU has tiles."""
    rng = np.random.default_rng(17)
    k, n = gb.block_values(type_name) * 3, 70  # two panels, the second partly empty
    blocks = gb.random_blocks(type_name, n, k, rng)
    bias = torch.randn(n)
    layer = quant.QuantLinear([gb.quantized_weight(type_name, blocks, k)], bias)
    tiles = [None] if cpu_linear.amx_tiles() is None else [True, False]
    try:
        for rows_from, on_tiles in itertools.product((1, 1 << 30), tiles):
            panel_from_rows(rows_from)
            if on_tiles is not None:
                cpu_linear.amx_tiles(on_tiles)
            for dtype in (torch.float32, torch.bfloat16):
                for m in (1, 7, 17, 64):
                    x = torch.randn(m, k).to(dtype)
                    _check(layer, [(type_name, blocks)], x, bias,
                           f"{type_name} m={m} from {rows_from}, tiles {on_tiles}")
    finally:
        if tiles[0] is not None:
            cpu_linear.amx_tiles(True)


@pytest.mark.parametrize("type_name", quant.KEPT_TYPES)
def test_many_bf16_rows_take_torchs_gemm_on_a_cpu_with_amx(type_name, monkeypatch):
    """From ``_AMX_FROM_ROWS`` bf16 rows the weight is dequantized whole and multiplied by
    torch (oneDNN's AMX tiles); fewer rows, or fp32, stay on the kernels."""
    if not native.has_amx():
        pytest.skip("this CPU has no AMX tiles (torch.cpu reports none)")
    if quant.isa() != quant.ISAS[-1]:
        pytest.skip(f"the kernels run {quant.isa()}, not the best ISA (ACTORLM_CPU_ISA?)")
    calls = []

    def linear(*args, **kwargs):
        calls.append(args[0].shape[0])
        return torch.nn.functional.linear(*args, **kwargs)

    monkeypatch.setattr(quant, "F", type("F", (), {"linear": staticmethod(linear)}))
    rng = np.random.default_rng(23)
    k, n = gb.block_values(type_name) * 2, 40
    parts = [(type_name, gb.random_blocks(type_name, n, k, rng)),
             ("Q8_0", gb.random_blocks("Q8_0", 8, k, rng))]  # a merged layer: two parts
    bias = torch.randn(n + 8) * 4
    layer = quant.QuantLinear([gb.quantized_weight(t, b, k) for t, b in parts], bias)
    many = quant._AMX_FROM_ROWS
    for m, dtype in ((many, torch.bfloat16), (many - 1, torch.bfloat16), (many, torch.float32)):
        x = torch.randn(m, k).to(dtype)
        _check(layer, parts, x, bias, f"{type_name} m={m} {dtype}")
    assert calls == [many]
    # a layer wider than a slice is dequantized a slice of output rows at a time (an LM head
    # of 128k rows would otherwise make a copy of itself), with the same bound
    monkeypatch.setattr(quant, "_DENSE_SLICE_ROWS", 16)
    calls.clear()
    _check(layer, parts, torch.randn(many, k).to(torch.bfloat16), bias, f"{type_name} sliced")
    assert calls == [many] * 3  # 48 rows: 16, 16 and 16 (the second part in the last)


@pytest.mark.parametrize("type_name,mutate", [
    ("Q4_0", "nibbles"), ("Q8_0", "scale"), ("Q4_K", "scale"), ("Q5_K", "high bit"),
    ("Q6_K", "scale")])
def test_the_bound_tells_a_wrong_kernel(type_name, mutate):
    """The tight bound fails the right output against the oracle of a subtly wrong weight: the
    two nibbles of each byte swapped, the scale of a neighbouring (sub-)block, a fifth bit
    from the wrong plane."""
    rng = np.random.default_rng(3)
    k, n, size = 512, 16, gb.gguf.GGML_QUANT_SIZES[gb.QTYPE[type_name]][1]
    blocks = gb.random_blocks(type_name, n, k, rng)
    wrong = blocks.copy().reshape(-1, size)
    if mutate == "nibbles":
        wrong[:, 2:] = (wrong[:, 2:] << 4) | (wrong[:, 2:] >> 4)
    elif type_name == "Q8_0":
        wrong[:, 0:2] = np.roll(wrong[:, 0:2], 1, axis=0)
    elif type_name == "Q4_K":
        wrong[:, [4, 5]] = wrong[:, [5, 4]]
    elif type_name == "Q6_K":
        wrong[:, [192, 193]] = wrong[:, [193, 192]]
    else:
        wrong[:, 16:48] = (wrong[:, 16:48] << 1) | (wrong[:, 16:48] >> 7)
    wrong = wrong.reshape(blocks.shape)
    layer = quant.QuantLinear([gb.quantized_weight(type_name, blocks, k)], None)
    x = torch.randn(4, k)
    y = layer(x).double()
    _, _, right, tight = _bounds([(type_name, blocks)], x, None, torch.float32)
    _, _, mutant, _ = _bounds([(type_name, wrong)], x, None, torch.float32)
    assert_within(y, right, tight, "the right oracle")
    with pytest.raises(AssertionError):
        assert_within(y, mutant, tight, "the wrong oracle")


@pytest.mark.parametrize("type_name", quant.KEPT_TYPES)
def test_dequantized_rows_equal_gguf(type_name):
    """Bit for bit in fp32: every product of an f16 scale and small integers is exact in fp32,
    and the one rounding (Q4_1's + m, the K formats' - dmin m) is numpy's own, in its order.
    bf16: that fp32 value rounded once to nearest even, as torch rounds it."""
    rng = np.random.default_rng(11)
    k = gb.block_values(type_name) * 2
    blocks = gb.random_blocks(type_name, 9, k, rng)
    weight = gb.quantized_weight(type_name, blocks, k)
    ids = torch.tensor([[8, 0, 3], [3, 3, 1]])
    expected = gb.dequantized(type_name, blocks).float()[ids]  # [2, 3, k]
    assert torch.equal(quant.dequantize_rows(weight, ids, torch.float32), expected)
    assert torch.equal(quant.dequantize_rows(weight, ids, torch.bfloat16), expected.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layers_whole_weight_dequantized_equals_gguf(dtype):
    """What a prefill on AMX multiplies by (``QuantLinear.dequantized``): every part, with
    its rows interleaved 16 at a time (Q4_1 and Q8_0 here, with the VNNI kernels) or as the
    file has them (Q4_0 of 21 rows, Q4_K), bit for bit as above."""
    rng = np.random.default_rng(12)
    k = 512
    parts = [("Q4_1", gb.random_blocks("Q4_1", 48, k, rng)),
             ("Q8_0", gb.random_blocks("Q8_0", 16, k, rng)),
             ("Q4_0", gb.random_blocks("Q4_0", 21, k, rng)),
             ("Q4_K", gb.random_blocks("Q4_K", 5, k, rng))]
    layer = quant.QuantLinear([gb.quantized_weight(t, b, k) for t, b in parts], None)
    if quant.isa() == "vnni":
        assert layer.interleaved == (True, True, False, False)
    expected = torch.cat([gb.dequantized(t, b) for t, b in parts]).float().to(dtype)
    assert torch.equal(layer.dequantized(dtype), expected)
    for start, end in ((0, 48), (40, 70), (47, 49), (64, 85), (84, 90)):  # across the parts
        assert torch.equal(layer.dequantized(dtype, start, end), expected[start:end])


def test_without_the_library_the_torch_path_computes_the_same(monkeypatch):
    rng = np.random.default_rng(5)
    k = 256
    parts = [(t, gb.random_blocks(t, 6, k, rng)) for t in ("Q8_0", "Q6_K")]
    bias = torch.randn(12)
    x = torch.randn(3, k)
    monkeypatch.setattr(quant, "_library", lambda: None)
    layer = quant.QuantLinear([gb.quantized_weight(t, b, k) for t, b in parts], bias)
    weight = torch.cat([gb.dequantized(t, b) for t, b in parts]).float()
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=0, atol=0)
    ids = torch.tensor([5, 0])
    assert torch.equal(quant.dequantize_rows(gb.quantized_weight(*parts[1], k), ids,
                                             torch.float32), weight[6:][ids])


def test_the_isa_can_be_forced_by_the_environment(monkeypatch):
    default = quant.isa()
    try:
        monkeypatch.setenv("ACTORLM_CPU_ISA", "scalar")
        quant._library.cache_clear()
        assert quant.isa() == "scalar"
        monkeypatch.setenv("ACTORLM_CPU_ISA", "sse9")
        quant._library.cache_clear()
        with pytest.raises(ValueError, match=r"ACTORLM_CPU_ISA='sse9'.*this CPU and build run"):
            quant.isa()
    finally:
        monkeypatch.delenv("ACTORLM_CPU_ISA")
        quant._library.cache_clear()
        quant.set_isa(default)
    lacking = [isa for isa, flag in _FLAGS.items() if flag and flag not in _cpu_flags()]
    for name in lacking:
        with pytest.raises(ValueError, match=name):
            quant.set_isa(name)


def test_what_a_layer_refuses():
    rng = np.random.default_rng(1)
    blocks = gb.random_blocks("Q8_0", 4, 64, rng)
    with pytest.raises(ValueError, match="in_features"):
        quant.QuantLinear([gb.quantized_weight("Q8_0", blocks, 64),
                           gb.quantized_weight("Q8_0", gb.random_blocks("Q8_0", 4, 96, rng), 96)],
                          None)
    with pytest.raises(NotImplementedError, match="Q2_K"):
        quant.QuantLinear([gb.QuantizedWeight("Q2_K", torch.zeros(84, dtype=torch.uint8),
                                              (1, 256))], None)
    assert [quant.native.function("actorlm_quant_kept")(int(gb.QTYPE[t]))
            for t in quant.KEPT_TYPES] == [1] * 7
    assert quant.native.function("actorlm_quant_kept")(int(gb.QTYPE["Q2_K"])) == 0


INTERLEAVED = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")  # csrc/quant_interleaved.h's types


@pytest.fixture
def vnni():
    """The VNNI kernels, for which rows are interleaved; the default ISA restored after."""
    if _FLAGS["vnni"] not in _cpu_flags():
        pytest.skip(f"CPU lacks {_FLAGS['vnni']}")
    default = quant.isa()
    quant.set_isa("vnni")
    yield
    quant.set_isa(default)


@pytest.mark.parametrize("type_name", INTERLEAVED)
def test_interleaved_rows_against_the_oracle(vnni, type_name):
    """Rows in multiples of 16 are interleaved for the VNNI kernels and give what the file's
    layout gives, at every number of rows of x, beside a part that is not interleaved."""
    rng = np.random.default_rng(11)
    k = 96  # three blocks
    parts = [(type_name, gb.random_blocks(type_name, 48, k, rng)),
             ("Q8_0", gb.random_blocks("Q8_0", 7, k, rng)),  # 7 rows: left as they are
             (type_name, gb.random_blocks(type_name, 16, k, rng))]
    bias = torch.randn(71)
    layer = quant.QuantLinear([gb.quantized_weight(t, b, k) for t, b in parts], bias)
    assert layer.interleaved == (True, False, True)
    try:
        for rows_from in (1, 1 << 30):  # the panels (the rows gathered back), the integers
            quant.set_panel_from_rows(rows_from)
            for dtype in (torch.float32, torch.bfloat16):
                for m in (1, 2, 3, 4, 5, 64):
                    x = torch.randn(m, k).to(dtype)
                    _check(layer, parts, x, bias, f"interleaved {type_name} m={m} {dtype}")
    finally:
        quant.set_panel_from_rows(None)


@pytest.mark.parametrize("type_name", INTERLEAVED)
def test_an_interleaved_copy_goes_back_to_the_file_layout(vnni, type_name):
    blocks = gb.random_blocks(type_name, 32, 64, np.random.default_rng(5))
    weight = gb.quantized_weight(type_name, blocks, 64)
    layer = quant.QuantLinear([weight], None)
    (interleaved,) = layer._blocks
    assert not torch.equal(interleaved, weight.blocks.reshape(-1))
    back = quant.file_layout(interleaved, type_name, weight.shape)
    assert torch.equal(back.blocks, weight.blocks.reshape(32, -1))


@pytest.mark.parametrize("type_name", INTERLEAVED)
def test_a_tied_embedding_looks_up_its_rows_in_the_lm_heads_interleaved_copy(vnni, type_name):
    """The CPU backend's tied embedding: the head holds the only copy, interleaved, and the
    lookups read rows back from it, bit for bit gguf's."""
    from actorlm.kernels import select_backend

    blocks = gb.random_blocks(type_name, 48, 64, np.random.default_rng(6))
    weight = gb.quantized_weight(type_name, blocks, 64)
    lookup, head = select_backend("cpu").prepare_tied_embedding(weight, torch.float32)
    assert head.interleaved == (True,)
    ids = torch.tensor([[47, 0, 17], [16, 15, 31]])
    expected = gb.dequantized(type_name, blocks).float()[ids]
    assert torch.equal(lookup(ids), expected)
    assert torch.equal(head.rows(ids, torch.bfloat16), expected.bfloat16())
