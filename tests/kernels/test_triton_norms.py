"""rms_norm, add_rms_norm and act_and_mul (Triton, interpreted on the CPU) against the float64
oracles in ``reference.py``, with bounds derived from each kernel's arithmetic.

Every bound is ``|exact| * (prod(1 + e_i) - 1)`` over the relative errors e_i the kernel commits
in turn (relative errors of a chain of products compose so), plus the oracle's own rounding of
``exact`` to the dtype, plus a floor for roundings among fp16's subnormals (absolute, at most
``tiny * u`` each). A rounding to fp32 of an fp32 value is the identity and is not counted.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from actorlm.kernels.backend import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from actorlm.kernels.reference import act_and_mul_ref, add_rms_norm_ref, rms_norm_ref
from actorlm.kernels.triton import activation as activation_module
from actorlm.kernels.triton import norms
from actorlm.kernels.triton.activation import act_and_mul
from actorlm.kernels.triton.norms import add_rms_norm, rms_norm
from tolerance import assert_within, rounding_error, sum_error, unit_roundoff

# tl.sigmoid's exp(-x) overflows to inf for very negative x under the interpreter's numpy, which
# warns; sigmoid is then 0, as on the GPU.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
HIDDEN_SIZES = [1, 7, 48, 100, 576]
NUM_ROWS = [1, 3, 17]
EPS = 1e-6
U32 = unit_roundoff(torch.float32)
# One fp32 op after a sum (÷H, +eps, rsqrt, exp, a divide): within 2 ulp = 4u, CUDA's
# approximate rsqrt / exp2 / divide included; the interpreter's numpy ops are correctly rounded.
OP = 4 * U32


def _chain(exact, dtype, fp32_error, dtype_roundings: int):
    """|exact| * (prod(1 + e) - 1): ``fp32_error`` relative error committed in fp32, then
    ``dtype_roundings`` roundings to ``dtype`` (none counted for fp32)."""
    ud = 0.0 if dtype == torch.float32 else unit_roundoff(dtype)
    return exact.abs() * ((1 + fp32_error) * (1 + ud) ** dtype_roundings - 1)


def _subnormal_floor(dtype, scale):
    # At most three roundings below the smallest normal, each <= tiny * u, then scaled.
    return 3 * torch.finfo(dtype).tiny * unit_roundoff(dtype) * (1 + scale.abs().double())


def _rms_exact(x, weight, unit_offset):
    """float64 normed * scale, unrounded, and the scale."""
    x64 = x.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)
    scale = weight.double() + 1.0 if unit_offset else weight.double()
    return normed * scale, scale


def _rms_kernel_error(exact, dtype, hidden, unit_offset):
    """The kernel's own error from ``exact`` (rms_norm's chain of roundings)."""
    # mean(x^2): each square rounded (u), the n positive squares summed (sum_error, relative
    # because |terms| sum to the sum), then ÷H and +eps; rsqrt halves the relative error of its
    # argument and adds its own; x * inv_rms rounds once more.
    mean_square = U32 + sum_error(hidden, 1.0) + 2 * OP
    normed = mean_square / 2 + OP + U32
    if unit_offset:  # 1 + w, normed * (1 + w) in fp32; one rounding to the dtype
        return _chain(exact, dtype, (1 + normed) * (1 + U32) ** 2 - 1, 1)
    # normed rounded to the dtype; w * normed in fp32 (exact for 16-bit operands); rounded
    return _chain(exact, dtype, (1 + normed) * (1 + U32) - 1, 2)


def _assert_rms_norm(out, x, weight, unit_offset, what):
    exact, scale = _rms_exact(x, weight, unit_offset)
    kernel_error = _rms_kernel_error(exact, x.dtype, x.shape[1], unit_offset)
    bound = kernel_error + rounding_error(exact, x.dtype) + _subnormal_floor(x.dtype, scale)
    assert_within(out, rms_norm_ref(x, weight, EPS, unit_offset), bound, what)
    # HF's expression: the same chain of roundings, another sum order; each within
    # kernel_error of exact.
    normed = torch.rms_norm(x.float(), (x.shape[1],), None, EPS)
    if unit_offset:
        hf = (normed * (1.0 + weight.float())).to(x.dtype)
    elif x.dtype == torch.float32:
        hf = torch.rms_norm(x, (x.shape[1],), weight, EPS)
    else:
        hf = weight * normed.to(x.dtype)
    assert_within(out, hf, 2 * kernel_error + _subnormal_floor(x.dtype, scale), what + " vs HF")


def _check_add_rms_norm(x, residual, weight, unit_offset, what):
    """Runs add_rms_norm (in place) and checks both results; returns them."""
    _, ref_stream = add_rms_norm_ref(x, residual, weight, EPS, unit_offset)
    exact_sum = x.double() + residual.double()
    out, stream = add_rms_norm(x, residual, weight, EPS, unit_offset)
    # The stream: the sum in fp32 (u32), rounded to the dtype (a double rounding), and the
    # oracle's one rounding of the exact sum.
    stream_bound = _chain(exact_sum, x.dtype, U32, 1) + rounding_error(exact_sum, x.dtype)
    assert_within(stream, ref_stream, stream_bound, f"add_rms_norm stream {what}")
    # The norm is rms_norm of the stream the kernel wrote.
    _assert_rms_norm(out, stream, weight, unit_offset, f"add_rms_norm {what}")
    return out, stream


def _inputs(num_rows, hidden, dtype, seed, width=None):
    gen = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(num_rows, width or hidden, generator=gen)).to(dtype)
    weight = torch.randn(hidden, generator=gen).to(dtype)
    return x, weight, gen


def _dtype_id(value):
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


def _sweep(size_name):
    """Every dtype x size (none a power of two but 1) x row count."""
    return pytest.mark.parametrize(f"dtype, {size_name}, num_rows",
                                   list(itertools.product(DTYPES, HIDDEN_SIZES, NUM_ROWS)),
                                   ids=_dtype_id)


UNIT_OFFSETS = pytest.mark.parametrize("unit_offset", [False, True])


@UNIT_OFFSETS
@_sweep("hidden")
def test_rms_norm_matches_reference(dtype, hidden, num_rows, unit_offset):
    x, weight, _ = _inputs(num_rows, hidden, dtype, seed=hidden * 31 + num_rows)
    out = rms_norm(x, weight, EPS, unit_offset)
    assert out.shape == x.shape and out.dtype == dtype
    _assert_rms_norm(out, x, weight, unit_offset, f"rms_norm {dtype} H={hidden} T={num_rows}")


@UNIT_OFFSETS
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_rms_norm_strided_rows_and_out(dtype, unit_offset):
    # x a column slice of a wider tensor (stride(0) = 105); out written into a strided view too.
    wide, weight, _ = _inputs(17, 100, dtype, seed=5, width=105)
    x = wide[:, 3:103]
    assert x.stride() == (105, 1)
    out_wide = torch.zeros(17, 130, dtype=dtype)
    out = rms_norm(x, weight, EPS, unit_offset, out=out_wide[:, 10:110])
    assert out.data_ptr() == out_wide[:, 10:110].data_ptr()
    assert bool((out_wide[:, :10] == 0).all() and (out_wide[:, 110:] == 0).all())
    _assert_rms_norm(out, x, weight, unit_offset, f"strided rms_norm {dtype}")
    expected = out.clone()
    assert torch.equal(rms_norm(x, weight, EPS, unit_offset, out=x), expected)  # in place


@UNIT_OFFSETS
@_sweep("hidden")
def test_add_rms_norm_in_place_matches_reference(dtype, hidden, num_rows, unit_offset):
    x, weight, gen = _inputs(num_rows, hidden, dtype, seed=hidden * 7 + num_rows)
    residual = (3 * torch.randn(num_rows, hidden, generator=gen)).to(dtype)
    x_ptr, residual_ptr = x.data_ptr(), residual.data_ptr()
    out, stream = _check_add_rms_norm(x, residual, weight, unit_offset, f"{dtype} H={hidden}")
    assert out.data_ptr() == x_ptr and stream.data_ptr() == residual_ptr


@UNIT_OFFSETS
@pytest.mark.parametrize("fused", [False, True])
def test_long_rows_stream_in_chunks(monkeypatch, fused, unit_offset):
    # Rows longer than the register tile take the two-pass path (7 chunks, the last partial).
    monkeypatch.setattr(norms, "_MAX_BLOCK_H", 16)
    x, weight, gen = _inputs(3, 100, torch.bfloat16, seed=11)
    if fused:
        residual = torch.randn(3, 100, generator=gen).to(torch.bfloat16)
        _check_add_rms_norm(x, residual, weight, unit_offset, "chunked")
    else:
        _assert_rms_norm(rms_norm(x, weight, EPS, unit_offset), x, weight, unit_offset,
                         "chunked rms_norm")


def test_zero_rows_launch_nothing(monkeypatch):
    monkeypatch.setattr(norms, "_rms_norm_kernel", None)  # a launch would fail
    monkeypatch.setattr(activation_module, "_act_and_mul_kernel", None)
    x, weight, _ = _inputs(0, 48, torch.bfloat16, seed=0)
    assert rms_norm(x, weight, EPS).shape == (0, 48)
    out, stream = add_rms_norm(x, x.clone(), weight, EPS, unit_offset=True)
    assert out.shape == stream.shape == (0, 48)
    assert act_and_mul(torch.empty(0, 96, dtype=torch.bfloat16), "silu").shape == (0, 48)


def _act_exact(gate_up, activation):
    """float64 act(gate) * up, unrounded; and z, the exponential's argument (sigmoid(z))."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    if activation in ("relu", "relu2"):  # (no exponential; relu2's square rounds once)
        return gate.clamp(min=0).pow(2 if activation == "relu2" else 1) * up, \
            torch.zeros_like(gate), up
    if activation == "gelu":  # (no exponential: its erf is gelu_tanh's special case below)
        return 0.5 * gate * (1 + torch.erf(gate / math.sqrt(2.0))) * up, torch.zeros_like(gate), up
    if activation == "silu":
        z = gate
    else:
        z = 2 * math.sqrt(2.0 / math.pi) * (gate + 0.044715 * gate.pow(3))
    return gate * torch.sigmoid(z) * up, z, up


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "relu", "relu2", "gelu"])
@_sweep("inter")
def test_act_and_mul_matches_reference(dtype, inter, num_rows, activation):
    gen = torch.Generator().manual_seed(inter * 13 + num_rows)
    wide = (3 * torch.randn(num_rows, 2 * inter + 6, generator=gen)).to(dtype)
    gate_up = wide[:, 2:2 + 2 * inter]  # strided rows
    out = act_and_mul(gate_up, activation)
    assert out.shape == (num_rows, inter) and out.dtype == dtype and out.is_contiguous()
    exact, z, up = _act_exact(gate_up, activation)
    # act = g * sigmoid(z) in fp32. sigmoid(z) = 1 / (1 + exp(-z)): exp's argument rounded
    # (relative |z| u in exp), exp, +1, divide: (9 + |z|) u. GeLU's z = 2c(g + k g^3) takes
    # four more roundings (no cancellation: g and g^3 share a sign), 5 u, which sigmoid carries
    # times |z| (1 - sigmoid) <= |z|: (9 + 6|z|) u. Then g * sigmoid, one more u.
    act_error = (10 + 6 * z.abs()) * U32
    # act rounded to the dtype; act * up in fp32 (exact for 16-bit operands); rounded.
    kernel_error = _chain(exact, dtype, (1 + act_error) * (1 + U32) - 1, 2)
    bound = kernel_error + rounding_error(exact, dtype) + _subnormal_floor(dtype, up)
    if activation == "gelu_tanh":
        # The oracle's 0.5 g (1 + tanh(y)) cancels in float64 for negative g: tanh's rounding
        # and the add leave 2 u64 of absolute error in (1 + tanh), times 0.5 |g up|.
        gate = gate_up.double()[:, :inter]
        bound = bound + (gate * up).abs() * unit_roundoff(torch.float64)
    if activation == "gelu":
        # 1 + erf(g / sqrt 2) cancels in fp32 for negative g, where fp32 erf is up to ~10
        # ulps off: that absolute error, times 0.5 |g up|
        gate = gate_up.double()[:, :inter]
        bound = bound + 8 * (gate * up).abs() * U32
    assert_within(out, act_and_mul_ref(gate_up, activation), bound,
                  f"{activation} {dtype} I={inter} T={num_rows}")


def _swiglu_oai(gate_up, clamp_gate=True, clamp_up=True):
    """float64 (clamp(up) + 1) * g * sigmoid(alpha g) of g = min(gate, limit), unrounded
    (without a clamp where told); and z = alpha g, sigmoid's argument."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    if clamp_gate:
        gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
    if clamp_up:
        up = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
    z = SWIGLU_OAI_ALPHA * gate
    return gate * torch.sigmoid(z) * (up + 1.0), z


def _assert_swiglu_oai(gate_up, what):
    """act_and_mul(gate_up, "swiglu_oai") within its bound of the oracle; returns the bound."""
    out = act_and_mul(gate_up, "swiglu_oai")
    dtype = gate_up.dtype
    assert out.shape == (gate_up.shape[0], gate_up.shape[1] // 2) and out.dtype == dtype
    exact, z = _swiglu_oai(gate_up)
    # fp32 throughout (the clamps exact): z = alpha g with alpha rounded to fp32 (2 u, which
    # sigmoid carries times |z|), sigmoid (9 + |z|) u as in the test above, g * sigmoid,
    # up + 1 and the product one u each: (12 + 3|z|) u; then one rounding to the dtype.
    kernel_error = _chain(exact, dtype, (12 + 3 * z.abs()) * U32, 1)
    up = gate_up.double()[:, gate_up.shape[1] // 2:]
    up_plus_one = up.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT) + 1
    bound = kernel_error + rounding_error(exact, dtype) + _subnormal_floor(dtype, up_plus_one)
    assert_within(out, act_and_mul_ref(gate_up, "swiglu_oai"), bound, what)
    return bound


@_sweep("inter")
def test_act_and_mul_swiglu_oai_matches_reference(dtype, inter, num_rows):
    gen = torch.Generator().manual_seed(inter * 17 + num_rows)
    # 6 sigma wide: about one value in eight past 7, and one in eight past -7
    wide = (6 * torch.randn(num_rows, 2 * inter + 6, generator=gen)).to(dtype)
    _assert_swiglu_oai(wide[:, 2:2 + 2 * inter], f"swiglu_oai {dtype} I={inter} T={num_rows}")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_act_and_mul_swiglu_oai_clamps_gate_above_and_up_both_ways(dtype):
    # every (gate, up) pair of values on either side of -7 and 7 (gate clamped above only)
    values = torch.tensor([-40.0, -9.0, -7.5, -6.5, -1.0, 0.5, 6.5, 7.5, 9.0, 40.0])
    gate, up = torch.cartesian_prod(values, values).unbind(-1)
    gate_up = torch.cat((gate.view(10, 10), up.view(10, 10)), -1).to(dtype)  # [10, 2 * 10]
    bound = _assert_swiglu_oai(gate_up, f"swiglu_oai clamps {dtype}")
    # each clamp left out moves some element past the bound, and only where it applies
    expected = act_and_mul_ref(gate_up, "swiglu_oai").double()
    gate, up = gate_up.double().chunk(2, dim=-1)
    for clamps, applies in (((False, True), gate > 7), ((True, False), up.abs() > 7)):
        moved = (_swiglu_oai(gate_up, *clamps)[0] - expected).abs() > bound
        assert moved.any() and not (moved & ~applies).any(), (clamps, moved)


def test_act_and_mul_swiglu_oai_rounds_once():
    # fp32 throughout, one rounding (vLLM's swigluoai_and_mul), not the activation rounded first
    gate_up = torch.tensor([[1.3, 2.1, 3.1, 2.3]], dtype=torch.bfloat16)  # [gate | up]
    gate, up = gate_up.float().chunk(2, dim=-1)
    glu = gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA)
    one_rounding = (glu * (up + 1)).to(torch.bfloat16)
    two_roundings = (glu.to(torch.bfloat16).float() * (up + 1)).to(torch.bfloat16)
    assert (one_rounding != two_roundings).all()
    assert torch.equal(act_and_mul(gate_up, "swiglu_oai"), one_rounding)


def test_act_and_mul_rounds_the_activation_first():
    # HF's two dtype ops: round(round(act(gate)) * up), not round(act(gate) * up).
    gate_up = torch.tensor([[1.3, 3.1]], dtype=torch.bfloat16)
    gate, up = gate_up.float().chunk(2, dim=-1)
    two_ops = (torch.nn.functional.silu(gate).to(torch.bfloat16).float() * up).to(torch.bfloat16)
    one_op = (torch.nn.functional.silu(gate) * up).to(torch.bfloat16)
    assert not torch.equal(two_ops, one_op)
    assert torch.equal(act_and_mul(gate_up, "silu"), two_ops)


def test_unknown_activation_raises():
    with pytest.raises(ValueError, match="silu.*gelu_tanh.*relu"):
        act_and_mul(torch.zeros(2, 8), "tanh")


@pytest.mark.parametrize("fused", [False, True])
@UNIT_OFFSETS
def test_hf_bits_in_bf16(unit_offset, fused):
    # Llama rounds normed to bf16 before the weight, Gemma does not; the fused norm normalises
    # the bf16 sum (torch's bf16 add). The other order's bits differ.
    x, weight, gen = _inputs(4, 48, torch.bfloat16, seed=3)
    residual = torch.randn(4, 48, generator=gen).to(torch.bfloat16)
    stream = x + residual if fused else x
    scale = 1.0 + weight.float() if unit_offset else weight.float()
    normed = torch.rms_norm(stream.float(), (48,), None, EPS)
    one_rounding = (normed * scale).to(torch.bfloat16)
    two_roundings = (normed.to(torch.bfloat16).float() * scale).to(torch.bfloat16)
    hf, other = (one_rounding, two_roundings) if unit_offset else (two_roundings, one_rounding)
    assert not torch.equal(hf, other)
    if fused:
        out, new_residual = add_rms_norm(x, residual, weight, EPS, unit_offset)
        assert torch.equal(new_residual, stream)
    else:
        out = rms_norm(x, weight, EPS, unit_offset)
    assert torch.equal(out, hf)
