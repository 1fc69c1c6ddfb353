"""Linear layers over packed weights, against linear_ref (float64, rounded once) within
``tolerance.linear_error``: each output is an fp32 sum of in_features products (and the bias),
in whatever order the GEMM (and ``-march=native``) chooses, rounded once to the layer's dtype.
bf16 gives F.linear's bits too where oneDNN runs it (not on the panel GEMM, which takes one or
two rows where the CPU has avx512_bf16 and sums in another order); fp32 runs the C++ panel GEMM
where the CPU has AVX-512 (AVX2 and FMA: up to 16 rows), else oneDNN up to 128 rows (its row
count rounded up to a multiple of 8) and MKL beyond, and MKL's own GEMV (F.linear's bits) at
one or two rows."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn.functional as F

from actorlm.kernels.cpu import linear as cpu_linear
from actorlm.kernels.cpu.linear import packed_linear
from actorlm.kernels.reference import linear_ref
from actorlm.models.layers import Linear
from tolerance import assert_within, linear_error


needs_onednn_bf16 = pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="oneDNN has no bf16 GEMM on this CPU (it needs AVX-512): bf16 linear layers "
           "run F.linear on their plain weights")


def _assert_matches_reference(got, x, weight, bias, what):
    expected = linear_ref(x, weight, bias)
    # fp32 sums of in_features products and the bias, rounded once to the layer's dtype
    bound = linear_error(x, weight, bias, expected, torch.float32, output=x.dtype)
    assert got.dtype == x.dtype
    assert_within(got, expected, bound, what)


@needs_onednn_bf16
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_linear_is_the_oracle_within_rounding_and_onednns_bits(with_bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen).to(torch.bfloat16)
    bias = torch.randn(96, generator=gen).to(torch.bfloat16) if with_bias else None
    linear = packed_linear(weight, bias)
    assert linear is not None, "no oneDNN bf16 here: bf16 linear layers run unpacked"
    panel_rows = 2 if cpu_linear._kernel(torch.bfloat16) is not None else 0
    with torch.inference_mode():
        for rows in (0, 1, 2, 3, 5, 64, 65, 300):  # below, at and above the packing hint
            x = torch.randn(rows, 80, generator=gen).to(torch.bfloat16)
            got = linear(x)
            _assert_matches_reference(got, x, weight, bias, f"{rows} rows")
            if not 0 < rows <= panel_rows:  # oneDNN on its packed layout: F.linear's bits
                assert torch.equal(got, F.linear(x, weight, bias)), rows


@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_fp32_linear_is_the_oracle_within_rounding_at_every_row_count(with_bias):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 80, generator=gen)
    bias = torch.randn(96, generator=gen) if with_bias else None
    linear = packed_linear(weight, bias)
    assert linear is not None, "no oneDNN here: fp32 linear layers run on MKL alone"
    with torch.inference_mode():
        for rows in (0, 1, 2, 3, 16, 17, 65, 100, 128, 129, 300):
            x = torch.randn(rows, 80, generator=gen)
            got = linear(x)
            _assert_matches_reference(got, x, weight, bias, f"{rows} rows")
            if rows < 3 and cpu_linear._kernel() is None:  # MKL's GEMV, bit for bit
                assert torch.equal(got, F.linear(x, weight, bias)), rows


def test_onednn_sees_sixteen_row_counts_whatever_the_batches():
    """oneDNN keeps memory for every row count it has run (a server's batches of prompts of
    every length grew it by 400 MiB): the rows it takes are padded to a multiple of 8, and the
    answer is the unpadded rows' all the same."""
    weight, bias = torch.randn(24, 16), torch.randn(24)
    seen = set()

    def onednn(x):
        seen.add(x.shape[0])
        return F.linear(x, weight, bias)

    for rows in range(300):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(cpu_linear._fp32_rows(weight, bias, onednn, x),
                                   F.linear(x, weight, bias))  # (a GEMM per row count)
    assert seen == set(range(8, 129, 8))


@pytest.fixture
def amx_tiles():
    """The bf16 panels on AMX tiles, switched back on after the test (which may compare the
    AVX-512 tile); skipped where there are none."""
    if cpu_linear.amx_tiles() is None:
        pytest.skip("no AMX tiles here (AMX-BF16 in the CPU and the build, and the kernel's "
                    "permission): bf16 panels run on the AVX-512 tile")
    yield cpu_linear.amx_tiles
    cpu_linear.amx_tiles(True)


@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_panels_on_amx_tiles_are_the_oracle_within_rounding_whatever_rows_are_beside(
        amx_tiles, with_bias):
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(100, 96, generator=gen).to(torch.bfloat16)  # k: three tiles' depth
    bias = torch.randn(100, generator=gen).to(torch.bfloat16) if with_bias else None
    linear = packed_linear(weight, bias)
    assert linear.max_rows == 64  # where the tiles beat oneDNN's GEMM; beyond, oneDNN
    x = torch.randn(65, 96, generator=gen).to(torch.bfloat16)
    with torch.inference_mode():
        three = linear(x[:3])
        # the AVX-512 tile below 3 rows; on the tiles a part of an A tile, one, two
        for rows in (1, 2, 3, 16, 17, 64):
            got = linear(x[:rows])
            _assert_matches_reference(got, x[:rows], weight, bias, f"{rows} rows")
            if rows >= 3:
                assert torch.equal(got[:3], three), rows  # a row's bits are its own
        assert torch.equal(linear(x), F.linear(x, weight, bias))  # 65 rows: oneDNN
        tiles = linear(x[:17])
        amx_tiles(False)  # the AVX-512 tile: the same sums, a pair's products rounded otherwise
        avx = linear(x[:17])
    _assert_matches_reference(avx, x[:17], weight, bias, "17 rows, AVX-512")
    assert (avx != tiles).float().mean() < 0.01  # a last bit now and then


def test_bf16_panels_keep_to_two_rows_where_k_is_not_a_multiple_of_32(amx_tiles):
    linear = packed_linear(torch.randn(100, 80).to(torch.bfloat16), None)
    assert linear.max_rows == 2


def test_packing_applies_to_bf16_and_fp32_only():
    assert packed_linear(torch.randn(8, 4, dtype=torch.float16), None) is None


@needs_onednn_bf16
def test_packed_weight_is_a_copy_taken_at_pack_time():
    # The model packs once its weights are loaded; later writes to the parameter do not leak in.
    from actorlm.kernels import select_backend

    layer = Linear(4, 8, False, torch.bfloat16, "cpu")
    weight = layer.weight
    with torch.no_grad():
        weight.copy_(torch.ones(8, 4))
    layer.prepare(select_backend("cpu"))
    assert layer.weight is None  # the layer lets its plain weight go
    x = torch.ones(2, 4, dtype=torch.bfloat16)
    with torch.inference_mode():
        expected = layer(x).clone()
        weight.zero_()
        assert torch.equal(layer(x), expected)


def _cpu_flags() -> set[str]:
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    return set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()


def test_the_fp32_panel_kernel_runs_where_the_cpu_has_avx512_or_avx2_and_fma():
    flags = _cpu_flags()
    kernel = cpu_linear._kernel()
    assert (kernel is not None) == ("avx512f" in flags or {"avx2", "fma"} <= flags)
    if kernel is not None:  # AVX-512's panels take every row count, AVX2's up to 16
        assert (kernel.panel, kernel.max_rows) == ((64, None) if "avx512f" in flags else (32, 16))


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 13, 64])
@pytest.mark.parametrize("out_features, in_features, bias",
                         [(960, 576, False), (100, 64, True), (576, 1536, False), (17, 40, True)])
def test_fp32_packed_linear_matches_reference(rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    linear = packed_linear(weight, b)
    _assert_matches_reference(linear(x), x, weight, b, f"{rows} x {in_features} -> {out_features}")


def test_fp32_packed_linear_takes_any_layout_and_refuses_other_dtypes():
    weight, x = torch.randn(70, 32), torch.randn(5, 64)
    linear = packed_linear(weight, None)
    strided = x[:, ::2]  # not unit-stride
    _assert_matches_reference(linear(strided), strided, weight, None, "strided")
    rows_apart = x[:, :32]  # unit-stride rows, 64 apart
    _assert_matches_reference(linear(rows_apart), rows_apart, weight, None, "rows apart")
    batched = torch.randn(2, 3, 32)  # [..., in_features], as F.linear takes it
    _assert_matches_reference(linear(batched), batched, weight, None, "batched")
    if cpu_linear._kernel() is not None:
        with pytest.raises(TypeError, match="bfloat16"):
            linear(rows_apart.bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32,
                                   pytest.param(torch.bfloat16, marks=needs_onednn_bf16)],
                         ids=str)
def test_a_loaded_model_lets_the_plain_linear_weights_go(tiny_llama_dir, dtype):
    from actorlm.kernels import select_backend
    from actorlm.models.loader import load_model

    model = load_model(tiny_llama_dir, dtype, "cpu", select_backend("cpu"))
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and not any(isinstance(m.prepared, cpu_linear.PlainLinear) for m in linears)
    assert all(m.weight is None for m in linears)  # the packed copy stands in for it
    # the tied LM head's weight was the embedding's, which the embedding still holds
    assert model.model.embed_tokens.weight.shape == (model.vocab_size, model.config.hidden_size)
