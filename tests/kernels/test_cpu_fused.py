"""The fused elementwise CPU kernels (``cpu_fused``) against their torch twins.

fp32: within 1e-5 relative (only the order of the sum of squares, and exp, differ). bf16: the
twins round where HF's ops round, so an intermediate lands one bf16 ulp off only near a tie:
at most two ulps apart in the result (one ulp of silu(gate) carried through the product), on
no more than 1 % of values."""

from __future__ import annotations

import pytest
import torch

from actorlm.kernels.cpu import fused, native
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
    ref_out, ref_residual = fused.add_rms_norm_ref(x, residual, weight, 1e-5)
    out, new_residual = fused.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    assert torch.equal(new_residual, ref_residual)  # one rounding of one add: exact
    assert_twins(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("rows, dim", [(1, 1536), (5, 80), (64, 1536)])
def test_silu_and_mul_matches_its_twin(dtype, rows, dim):
    gen = torch.Generator().manual_seed(rows * dim)
    gate_up = (4 * torch.randn(rows, 2 * dim, generator=gen)).to(dtype)
    assert_twins(fused.silu_and_mul(gate_up), fused.silu_and_mul_ref(gate_up))


def test_strided_or_foreign_inputs_take_the_torch_path():
    gate_up = torch.randn(4, 20, dtype=torch.float64)
    assert torch.equal(fused.silu_and_mul(gate_up), fused.silu_and_mul_ref(gate_up))
    wide = torch.randn(4, 16)
    x, residual = wide[:, :8], torch.randn(4, 8)  # x is strided
    out, new_residual = fused.add_rms_norm(x, residual, torch.ones(8), 1e-6)
    ref_out, ref_residual = fused.add_rms_norm_ref(x, residual, torch.ones(8), 1e-6)
    assert torch.equal(out, ref_out) and torch.equal(new_residual, ref_residual)


def test_argmax_takes_the_first_maximum_and_copes_with_banned_tokens():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 49_152, generator=gen)
    logits[1, [7, 300, 40_000]] = 50.0  # a tie: the first index wins, as torch's
    logits[2, :] = float("-inf")
    logits[2, 12_345] = -3.0  # every other token banned
    logits[3, -1] = 99.0  # the very last index
    assert torch.equal(fused.argmax(logits), logits.argmax(dim=-1))
    assert fused.argmax(logits)[1].item() == 7


def _rope_case(dtype, num_tokens, num_heads, num_kv_heads, head_dim, seed):
    """A fused projection, RoPE tables as the model builds them, and caches with scattered
    slots for each token."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen) * 50
    angles = torch.cat((angles, angles), dim=-1)
    sign = torch.cat((-torch.ones(head_dim // 2), torch.ones(head_dim // 2)))
    cos, sin = angles.cos().to(dtype)[:, None], (angles.sin().to(dtype) * sign.to(dtype))[:, None]
    caches = [torch.zeros(8, 4, num_kv_heads, head_dim, dtype=dtype) for _ in range(2)]
    slots = torch.randperm(32, generator=gen)[:num_tokens]
    return qkv.to(dtype), cos, sin, caches, slots


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("num_tokens, num_heads, num_kv_heads, head_dim",
                         [(1, 9, 3, 64), (5, 4, 4, 128), (7, 2, 1, 80)])
def test_rope_and_write_kv_matches_the_torch_ops(dtype, num_tokens, num_heads, num_kv_heads,
                                                 head_dim):
    from actorlm.models.llama import apply_rope

    qkv, cos, sin, (k_cache, v_cache), slots = _rope_case(
        dtype, num_tokens, num_heads, num_kv_heads, head_dim, seed=num_tokens + head_dim)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qk = qkv[:, :q_size + kv_size].view(num_tokens, -1, head_dim)
    ref_qk = apply_rope(qk, cos, sin)
    ref_v = qkv[:, q_size + kv_size:].clone()
    assert fused.rope_and_write_kv(qkv, cos, sin, k_cache, v_cache, slots, num_heads,
                                       num_kv_heads)
    assert_twins(qk, ref_qk)  # rotated in place
    assert torch.equal(qkv[:, q_size + kv_size:], ref_v)  # v untouched
    written = torch.zeros(32, dtype=torch.bool)
    written[slots] = True
    v_heads = ref_v.view(num_tokens, -1, head_dim)
    for cache, ref in ((k_cache, qk[:, num_heads:]), (v_cache, v_heads)):
        flat = cache.view(32, num_kv_heads, head_dim)
        assert torch.equal(flat[slots], ref)  # exactly the (rotated) rows, at their slots
        assert not flat[~written].any()  # and nowhere else


def test_rope_and_write_kv_declines_what_it_does_not_take():
    qkv, cos, sin, (k_cache, v_cache), slots = _rope_case(torch.float32, 3, 2, 1, 64, seed=5)
    before = qkv.clone()
    for args in [(qkv.double(), cos.double(), sin.double(), k_cache.double(), v_cache.double(),
                  slots), (qkv, cos, sin, k_cache, v_cache, slots.int()),
                 (qkv[:2], cos, sin, k_cache, v_cache, slots)]:
        assert not fused.rope_and_write_kv(*args, 2, 1)
    assert torch.equal(qkv, before) and not k_cache.any() and not v_cache.any()
