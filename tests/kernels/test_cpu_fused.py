"""The fused elementwise CPU kernels (``kernels/cpu/fused.py``) against the float64 oracle.

Each bound follows from the kernel's arithmetic (``tests/tolerance.py``): an RMS norm's
1/rms carries its fp32 sum of squares' error (half of it, through the square root) and a few
fp32 roundings; a norm of Llama's kind rounds the normed value to the dtype before the weight
multiplies it; the output is rounded once more. Where the C++ kernel and the torch path
(``kernels/portable.py``, HF's ops) round at the same places, they are compared exactly.
"""

from __future__ import annotations

import pytest
import torch

from actorlm.kernels import ActivationQuant, Norm, portable
from actorlm.kernels.cpu import fused, native
from actorlm.kernels.reference import act_and_mul_ref, rms_norm_ref, write_kv_ref
from paged_batches import dtype_id
from tolerance import assert_within, rounding_error, sum_error, unit_roundoff

DTYPES = [torch.float32, torch.bfloat16]
FP32_OPS = 4  # fp32 roundings of a few elementwise ops (division, square root, exp, tanh)


def norm_bound(x: torch.Tensor, norm: Norm, dtype: torch.dtype) -> torch.Tensor:
    """The bound on a kernel's ``norm`` of x [.., H] against ``rms_norm_ref`` in float64."""
    x64, w64 = x.double(), norm.weight.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + norm.eps)
    scale = (w64 + 1.0) if norm.unit_offset else w64
    relative = sum_error(x.shape[-1], 1.0) / 2 + FP32_OPS * unit_roundoff(torch.float32)
    bound = relative * (normed * scale).abs()
    if not norm.unit_offset:  # normed rounded to the dtype before the weight multiplies it
        bound = bound + rounding_error(normed, dtype) * scale.abs()
    return bound + rounding_error(normed * scale, dtype)


def _norm(dim, dtype, gen, unit_offset=False) -> Norm:
    return Norm(torch.randn(dim, generator=gen).to(dtype), 1e-5, unit_offset)


def test_the_library_builds_here():
    assert native.library() is not None


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("rows, dim", [(1, 576), (7, 64), (64, 960), (3, 37)])
def test_rms_norm_is_the_oracle_within_its_rounding(dtype, unit_offset, rows, dim):
    gen = torch.Generator().manual_seed(rows + dim)
    wide = (3 * torch.randn(rows, dim + 5, generator=gen)).to(dtype)
    norm = _norm(dim, dtype, gen, unit_offset)
    for x in (wide[:, :dim].contiguous(), wide[:, 5:]):  # dense rows and strided ones
        out = fused.rms_norm(x, norm)
        assert out.dtype == dtype and out.is_contiguous()
        assert_within(out, rms_norm_ref(x.double(), norm.weight.double(), 1e-5, unit_offset),
                      norm_bound(x, norm, dtype), f"{dtype} {unit_offset}")
        assert_within(portable.rms_norm(x, norm),
                      rms_norm_ref(x.double(), norm.weight.double(), 1e-5, unit_offset),
                      norm_bound(x, norm, dtype), "the torch path")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("unit_offset", [False, True])
@pytest.mark.parametrize("rows, dim", [(1, 576), (7, 64), (64, 960)])
def test_add_rms_norm_is_the_oracle_within_its_rounding(dtype, unit_offset, rows, dim):
    gen = torch.Generator().manual_seed(rows * dim)
    x = (3 * torch.randn(rows, dim, generator=gen)).to(dtype)
    residual = torch.randn(rows, dim, generator=gen).to(dtype)
    norm = _norm(dim, dtype, gen, unit_offset)
    out, stream = fused.add_rms_norm(x.clone(), residual.clone(), norm)
    assert torch.equal(stream, x + residual)  # one rounding of one add: exact
    assert_within(out, rms_norm_ref(stream.double(), norm.weight.double(), 1e-5, unit_offset),
                  norm_bound(stream, norm, dtype), f"{dtype} {unit_offset}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("num_tokens, num_heads, num_kv_heads, head_dim",
                         [(1, 9, 3, 64), (5, 4, 4, 128), (3, 2, 1, 80)])
def test_head_rms_norm_norms_each_q_and_k_head_by_its_weight(dtype, num_tokens, num_heads,
                                                             num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(num_heads * head_dim)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (2 * torch.randn(num_tokens, width + 4, generator=gen)).to(dtype)[:, 2:-2]  # strided
    before = qkv.clone()
    q_norm, k_norm = _norm(head_dim, dtype, gen), _norm(head_dim, dtype, gen)
    assert fused.head_rms_norm(qkv, num_heads, num_kv_heads, head_dim, q_norm, k_norm)
    heads = before.view(num_tokens, -1, head_dim)
    for got, norm, part in ((qkv[:, :num_heads * head_dim], q_norm, heads[:, :num_heads]),
                            (qkv[:, num_heads * head_dim:-num_kv_heads * head_dim], k_norm,
                             heads[:, num_heads:num_heads + num_kv_heads])):
        expected = rms_norm_ref(part.double(), norm.weight.double(), 1e-5)
        assert_within(got.reshape(expected.shape), expected, norm_bound(part, norm, dtype))
    assert torch.equal(qkv[:, -num_kv_heads * head_dim:], before[:, -num_kv_heads * head_dim:])


def test_head_rms_norm_declines_norms_it_cannot_run_alike():
    qkv = torch.randn(2, 4 * 16)
    before = qkv.clone()
    q_norm = Norm(torch.ones(16), 1e-5)
    assert not fused.head_rms_norm(qkv, 2, 1, 16, q_norm, q_norm._replace(eps=1e-6))
    assert not fused.head_rms_norm(qkv, 2, 2, 16, q_norm, q_norm)  # not the projection's width
    assert torch.equal(qkv, before)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "relu", "relu2", "gelu"])
@pytest.mark.parametrize("rows, dim", [(1, 1536), (5, 80), (64, 1536)])
def test_act_and_mul_is_the_oracle_within_its_rounding(dtype, activation, rows, dim):
    gen = torch.Generator().manual_seed(rows * dim)
    gate_up = (4 * torch.randn(rows, 2 * dim, generator=gen)).to(dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    act = act_and_mul_ref(torch.cat((gate, torch.ones_like(up)), -1), activation)
    # act(gate) in fp32 (a few roundings of its value, and of gate / 2 where GeLU's
    # 1 + tanh cancels), rounded to the dtype, times up, rounded
    act_error = FP32_OPS * unit_roundoff(torch.float32) * (act.abs() + gate.abs() / 2)
    if activation == "gelu":  # 1 + erf cancels for negative g, where an fp32 erf (torch's
        # too) is up to ~10 ulps of 1 off
        act_error = act_error + 16 * unit_roundoff(torch.float32) * gate.abs() / 2
    expected = act * up
    bound = (act_error + rounding_error(act, dtype)) * up.abs() + rounding_error(expected, dtype)
    for out in (fused.act_and_mul(gate_up, activation),
                portable.act_and_mul(gate_up, activation)):
        assert out.dtype == dtype
        assert_within(out, expected, bound, f"{dtype} {activation}")


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_the_clamped_swiglu_is_the_oracle_within_its_roundings(dtype):
    """GPT-OSS's activation on gate and up values well past the clamp's +-7: the C++ kernel
    and transformers' ops (the torch path) round at the same five places, each moving the
    output by at most a unit roundoff of it, and the rounded z = 1.702 g moves sigmoid by
    |z| sigmoid(-z) of one."""
    gen = torch.Generator().manual_seed(7)
    gate_up = (8 * torch.randn(64, 2 * 160, generator=gen)).to(dtype)
    expected = act_and_mul_ref(gate_up, "swiglu_oai")
    z = 1.702 * gate_up.double()[:, :160].clamp(max=7)
    relative = (5 + z.abs() * torch.sigmoid(-z)) * unit_roundoff(dtype) + \
        FP32_OPS * unit_roundoff(torch.float32)
    bound = relative * expected.double().abs() + rounding_error(expected, dtype)
    fast, ops = fused.act_and_mul(gate_up, "swiglu_oai"), portable.act_and_mul(gate_up,
                                                                                "swiglu_oai")
    for out in (fast, ops):
        assert_within(out, expected, bound, f"{dtype} swiglu_oai")
    g, up = gate_up.double().chunk(2, -1)
    clamped = g.clamp(max=7)
    for unclamped in ((up.clamp(-7, 7) + 1) * g * torch.sigmoid(1.702 * g),  # gate's clamp
                      (up + 1) * clamped * torch.sigmoid(1.702 * clamped)):  # up's
        assert ((unclamped - expected.double()).abs() > bound).any()


def test_strided_or_foreign_inputs_take_the_torch_path():
    gate_up = torch.randn(4, 20, dtype=torch.float64)
    assert torch.equal(fused.act_and_mul(gate_up, "silu"), portable.act_and_mul(gate_up, "silu"))
    wide = torch.randn(4, 16)
    x, residual = wide[:, :8], torch.randn(4, 8)  # x is strided
    norm = Norm(torch.ones(8), 1e-6)
    out, stream = fused.add_rms_norm(x, residual, norm)
    ref_out, ref_stream = portable.add_rms_norm(x, residual, norm)
    assert torch.equal(out, ref_out) and torch.equal(stream, ref_stream)
    with pytest.raises(ValueError, match="silu.*relu"):
        fused.act_and_mul(torch.randn(2, 8), "tanh")


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
def test_rope_and_write_kv_rotates_and_writes_exactly_its_slots(dtype, num_tokens, num_heads,
                                                                num_kv_heads, head_dim):
    qkv, cos, sin, (k_cache, v_cache), slots = _rope_case(
        dtype, num_tokens, num_heads, num_kv_heads, head_dim, seed=num_tokens + head_dim)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qk = qkv[:, :q_size + kv_size].view(num_tokens, -1, head_dim)
    before = qk.double()
    # the oracle from the same tables: x cos + rotate_half(x) sin, in float64; the kernel
    # rounds both products and their sum to the dtype (fp32: the products may fuse into one)
    cos64, sin64 = cos.double(), sin.double()
    products = (before * cos64, before.roll(head_dim // 2, -1) * sin64)
    expected = products[0] + products[1]
    bound = rounding_error(products[0], dtype) + rounding_error(products[1], dtype) + \
        rounding_error(expected, dtype)
    ref_v = qkv[:, q_size + kv_size:].clone()
    torch_path = portable.apply_rope(qk.clone(), cos, sin)
    assert fused.rope_and_write_kv(qkv, cos, sin, k_cache, v_cache, slots, num_heads,
                                   num_kv_heads)
    assert_within(qk, expected, bound, "rotated in place")
    if dtype == torch.bfloat16:  # the same three roundings as the torch ops: their bits
        assert torch.equal(qk, torch_path)
    assert torch.equal(qkv[:, q_size + kv_size:], ref_v)  # v untouched
    written = torch.zeros(32, dtype=torch.bool)
    written[slots] = True
    v_heads = ref_v.view(num_tokens, -1, head_dim)
    for cache, ref in ((k_cache, qk[:, num_heads:]), (v_cache, v_heads)):
        flat = cache.view(32, num_kv_heads, head_dim)
        assert torch.equal(flat[slots], ref)  # exactly the (rotated) rows, at their slots
        assert not flat[~written].any()  # and nowhere else


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_rope_and_write_kv_rounds_into_fp8_caches_as_the_oracle(dtype, cache_dtype):
    # the rotated k and the v of each row rounded into FP8 caches, bit for bit as the oracle
    # rounds the same rows (magnitudes over every binade the formats hold, and past E4M3's
    # largest: saturated)
    qkv, cos, sin, _, slots = _rope_case(dtype, 7, 2, 2, 64, seed=11)
    magnitude = torch.exp2(torch.randint(-20, 17, (qkv.shape[1],),
                                         generator=torch.Generator().manual_seed(3)).float())
    qkv = (qkv.float() * magnitude).to(dtype)
    caches = [torch.zeros(8, 4, 2, 64, dtype=cache_dtype) for _ in range(2)]
    rotated = portable.apply_rope(qkv[:, :256].reshape(7, 4, 64), cos, sin)[:, 2:]
    expected = [c.clone() for c in caches]
    write_kv_ref(rotated, qkv[:, 256:].reshape(7, 2, 64), *expected, slots)
    assert fused.rope_and_write_kv(qkv, cos, sin, *caches, slots, 2, 2)
    for got, want in zip(caches, expected):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert caches[0].float().abs().max() == torch.finfo(cache_dtype).max  # (saturated)


@pytest.mark.skipif(native.library() is None, reason="needs a C++ compiler to build the kernels")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_fp8_cache_values_widen_exactly(dtype, cache_dtype):
    # every byte an FP8 cache can hold but NaN's, in a length that leaves a tail past the
    # last whole vector: the C++ widening equals torch's conversion
    every = torch.arange(256, dtype=torch.uint8).view(cache_dtype)
    every = every[~every.float().isnan() & every.float().isfinite()]
    x = every.repeat(3)[:-5].contiguous()
    assert torch.equal(fused.widened(x, dtype), x.to(dtype))


def test_rope_and_write_kv_declines_what_it_does_not_take():
    qkv, cos, sin, (k_cache, v_cache), slots = _rope_case(torch.float32, 3, 2, 1, 64, seed=5)
    before = qkv.clone()
    for args in [(qkv.double(), cos.double(), sin.double(), k_cache.double(), v_cache.double(),
                  slots), (qkv, cos, sin, k_cache, v_cache, slots.int()),
                 (qkv[:2], cos, sin, k_cache, v_cache, slots)]:
        assert not fused.rope_and_write_kv(*args, 2, 1)
    assert torch.equal(qkv, before) and not k_cache.any() and not v_cache.any()


@pytest.mark.skipif(native.library() is None, reason="needs a C++ compiler to build the kernels")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("quant", [ActivationQuant(), ActivationQuant(group=32),
                                   ActivationQuant(scale=0.01)], ids=["row", "group", "static"])
def test_fp8_rounding_has_the_portable_bits(dtype, quant):
    """Rows of magnitudes from 1e-8 to 1e3 (a row of zeros; values on e4m3's ties, between its
    subnormals, beyond 448 times a static scale; strided rows): the C++ rounding equals the
    torch ops' bit for bit."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 200, generator=gen) * torch.logspace(-8, 3, 9)[:, None]
    x[4] = 0
    x[5, :8] = torch.tensor([2.5, 3.5, 9.0, 17.0, 2**-10, 3 * 2**-10, 5.0, -448.0]) * 0.01
    x = x.to(dtype)[:, :192]  # rows 200 apart
    got = fused.round_to_fp8(x, quant)
    assert torch.equal(got, portable.round_to_fp8(x, quant))
    assert torch.equal(got[4], torch.zeros(192, dtype=dtype))
