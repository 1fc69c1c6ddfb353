"""Packed linear layers (``cpu_linear``) against ``F.linear``: the same function of x, to fp32
rounding (the GEMMs sum in other orders), for every row count and layer shape."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.nn.functional as F

from actorlm.kernels import cpu_linear


def _has_avx512() -> bool:
    cpuinfo = pathlib.Path("/proc/cpuinfo")
    return cpuinfo.exists() and " avx512f" in cpuinfo.read_text()


def test_the_fp32_panel_kernel_runs_where_the_cpu_has_avx512():
    assert (cpu_linear._kernel() is not None) == _has_avx512()


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 7, 13, 64])
@pytest.mark.parametrize("out_features, in_features, bias",
                         [(960, 576, False), (100, 64, True), (576, 1536, False), (17, 40, True)])
def test_fp32_packed_linear_matches_f_linear(rows, out_features, in_features, bias):
    gen = torch.Generator().manual_seed(rows * out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    b = torch.randn(out_features, generator=gen) if bias else None
    x = torch.randn(rows, in_features, generator=gen)
    linear = cpu_linear.packed_linear(weight, b)
    # sums of in_features products, in another order: a few fp32 ulps of the largest terms
    torch.testing.assert_close(linear(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


def test_fp32_packed_linear_takes_strided_rows_and_other_dtypes():
    weight, x = torch.randn(70, 32), torch.randn(5, 64)
    linear = cpu_linear.packed_linear(weight, None)
    strided = x[:, ::2]  # not unit-stride: the plain path
    torch.testing.assert_close(linear(strided), F.linear(strided, weight), rtol=0, atol=1e-4)
    rows_apart = x[:, :32]  # unit-stride rows, 64 apart
    torch.testing.assert_close(linear(rows_apart), F.linear(rows_apart, weight), rtol=0, atol=1e-4)
