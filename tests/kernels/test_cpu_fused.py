"""The fused elementwise CPU kernels (``cpu_fused``) against their torch twins.

fp32: within 1e-5 relative (only the order of the sum of squares, and exp, differ). bf16: the
twins round where HF's ops round, so an intermediate lands one bf16 ulp off only near a tie:
at most two ulps apart in the result (one ulp of silu(gate) carried through the product), on
no more than 1 % of values."""

from __future__ import annotations

import pytest
import torch

from actorlm.kernels import cpu_fused, native
from paged_batches import dtype_id

DTYPES = [torch.float32, torch.bfloat16]


def assert_twins(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        return
    ulp = 2.0 ** -7 * ref.float().abs().clamp_min(2.0 ** -126)
    diff = (out.float() - ref.float()).abs()
    assert bool((diff <= 2.02 * ulp).all()), diff.max().item()
    assert (out != ref).float().mean().item() <= 0.01


def test_the_library_builds_here():
    assert native.library() is not None


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("rows, dim", [(1, 576), (7, 64), (64, 960)])
def test_add_rms_norm_matches_its_twin(dtype, rows, dim):
    gen = torch.Generator().manual_seed(rows + dim)
    x = (3 * torch.randn(rows, dim, generator=gen)).to(dtype)
    residual = torch.randn(rows, dim, generator=gen).to(dtype)
    weight = torch.randn(dim, generator=gen).to(dtype)
    ref_out, ref_residual = cpu_fused.add_rms_norm_ref(x, residual, weight, 1e-5)
    out, new_residual = cpu_fused.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    assert torch.equal(new_residual, ref_residual)  # one rounding of one add: exact
    assert_twins(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("rows, dim", [(1, 1536), (5, 80), (64, 1536)])
def test_silu_and_mul_matches_its_twin(dtype, rows, dim):
    gen = torch.Generator().manual_seed(rows * dim)
    gate_up = (4 * torch.randn(rows, 2 * dim, generator=gen)).to(dtype)
    assert_twins(cpu_fused.silu_and_mul(gate_up), cpu_fused.silu_and_mul_ref(gate_up))


def test_strided_or_foreign_inputs_take_the_torch_path():
    gate_up = torch.randn(4, 20, dtype=torch.float64)
    assert torch.equal(cpu_fused.silu_and_mul(gate_up), cpu_fused.silu_and_mul_ref(gate_up))
    wide = torch.randn(4, 16)
    x, residual = wide[:, :8], torch.randn(4, 8)  # x is strided
    out, new_residual = cpu_fused.add_rms_norm(x, residual, torch.ones(8), 1e-6)
    ref_out, ref_residual = cpu_fused.add_rms_norm_ref(x, residual, torch.ones(8), 1e-6)
    assert torch.equal(out, ref_out) and torch.equal(new_residual, ref_residual)


def test_argmax_takes_the_first_maximum_and_copes_with_banned_tokens():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 49_152, generator=gen)
    logits[1, [7, 300, 40_000]] = 50.0  # a tie: the first index wins, as torch's
    logits[2, :] = float("-inf")
    logits[2, 12_345] = -3.0  # every other token banned
    logits[3, -1] = 99.0  # the very last index
    assert torch.equal(cpu_fused.argmax(logits), logits.argmax(dim=-1))
    assert cpu_fused.argmax(logits)[1].item() == 7
