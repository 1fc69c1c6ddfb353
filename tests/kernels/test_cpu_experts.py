"""The CPU wing's routed experts on the panel GEMM (``kernels/cpu/experts.py``, ``csrc/moe.cpp``):
its routing is ``moe.route``'s (the same experts, the weights within an fp32 rounding; a tie to
the lower index), and given a routing its result is ``moe.grouped_experts``' roundings over the
panel GEMM's bits, to the bit, for a decode row and for prefills whose rows share experts;
experts the kernel cannot take stay as they came, on the torch path."""

from __future__ import annotations

import pytest
import torch

from actorlm.kernels import Experts, moe, select_backend
from actorlm.kernels.cpu import experts as cpu_experts
from actorlm.kernels.cpu import fused
from actorlm.kernels.cpu import linear as cpu_linear

DTYPES = [torch.float32, torch.bfloat16]
HIDDEN, INTERMEDIATE = 80, 40  # neither a multiple of the 64-column panel


def _needs(dtype):
    if cpu_linear._kernel(dtype) is None:
        pytest.skip(f"no {dtype} panel GEMM here (fp32: AVX-512 or AVX2 and FMA; bf16: avx512_bf16)")


def _experts(num_experts, dtype, activation="silu", seed=0, hidden=HIDDEN,
             intermediate=INTERMEDIATE):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * 0.2
    down = torch.randn(num_experts, hidden, intermediate, generator=gen) * 0.2
    return Experts(gate_up.to(dtype), down.to(dtype), activation)


def _unused(x):  # the wider GEMM a panel layer takes beyond its rows: one row never needs it
    raise AssertionError("one row ran beyond the panel GEMM")


def _rowwise(layer, x):
    """``layer(x)`` as the experts run it: each row computed the same whatever the rows beside
    it (bf16 on AMX tiles where the CPU has them, at every row count)."""
    y = x.new_empty(x.shape[0], layer.out_features)
    layer.kernel.rowwise(x.data_ptr(), x.stride(0), layer.packed.data_ptr(), None, y.data_ptr(),
                         x.shape[0], layer.out_features, layer.in_features)
    return y


def _panel_reference(x, weights, ids, experts):
    """grouped_experts' roundings, one token at a time, each projection a PanelLinear."""
    out = []
    for t in range(x.shape[0]):
        order = ids[t].argsort()
        total = None
        for j in order.tolist():
            e = int(ids[t, j])
            gate_up, down = (cpu_linear.PanelLinear.build(w.contiguous(), None, wide=_unused)
                             for w in (experts.gate_up[e], experts.down[e]))
            hidden = fused.act_and_mul(_rowwise(gate_up, x[t:t + 1]), experts.activation)
            slot = (_rowwise(down, hidden) * weights[t, j]).to(x.dtype)
            total = slot if total is None else total + slot
        out.append(total)
    return torch.cat(out)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 8, 2), (2, 16, 4), (37, 6, 2),
                                                            (64, 8, 1)])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "softmax"])
def test_routing_picks_the_experts_moe_route_picks(dtype, num_tokens, num_experts, top_k,
                                                   renormalize):
    _needs(torch.float32)
    logits = torch.randn(num_tokens, num_experts,
                         generator=torch.Generator().manual_seed(num_tokens)).to(dtype)
    weights, ids = cpu_experts.route(logits, top_k, renormalize)
    expected_weights, expected_ids = moe.route(logits, top_k, renormalize)
    assert torch.equal(ids, expected_ids)
    torch.testing.assert_close(weights, expected_weights, atol=0, rtol=4e-7)


def test_a_tie_goes_to_the_lower_index():
    _needs(torch.float32)
    logits = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0], [0.5] * 5])
    weights, ids = cpu_experts.route(logits, 3, True)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(weights, torch.full((2, 3), 1 / 3))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh", "relu"])
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 8, 2), (2, 8, 3), (29, 6, 2),
                                                            (9, 3, 3)])
# (64, 32): both projections' k a multiple of 32, which bf16 runs on AMX tiles where they are
@pytest.mark.parametrize("hidden, intermediate", [(HIDDEN, INTERMEDIATE), (64, 32)])
def test_experts_have_the_grouped_torch_paths_roundings_over_the_panel_gemm(
        dtype, activation, num_tokens, num_experts, top_k, hidden, intermediate):
    _needs(dtype)
    experts = _experts(num_experts, dtype, activation, hidden=hidden, intermediate=intermediate)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = moe.route(logits, top_k, True)
    prepared = cpu_experts.PanelExperts.build(experts)
    out = prepared.run(x, weights, ids)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, _panel_reference(x, weights, ids, experts))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_the_door_prepares_experts_once_and_runs_them_in_cpp(dtype):
    _needs(dtype)
    backend, experts = select_backend("cpu"), _experts(8, dtype)
    prepared = backend.prepare_experts(experts)
    assert isinstance(prepared, cpu_experts.PanelExperts)
    x = torch.randn(5, HIDDEN).to(dtype)
    logits = torch.randn(5, 8).to(dtype)
    weights, ids = cpu_experts.route(logits, 2, False)
    assert torch.equal(backend.fused_moe(x, logits, prepared, 2, False),
                       prepared.run(x, weights, ids))
    with pytest.raises(TypeError, match="got a"):
        backend.fused_moe(x.half(), logits, prepared, 2, False)


def test_experts_the_kernel_cannot_take_stay_on_the_torch_path(monkeypatch):
    backend = select_backend("cpu")
    half = _experts(4, torch.float16)
    assert backend.prepare_experts(half) is half
    monkeypatch.setattr(cpu_linear, "_kernel", lambda dtype=None: None)  # no AVX-512
    plain = _experts(4, torch.float32)
    assert backend.prepare_experts(plain) is plain


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("n, k", [(80, 40), (130, 41), (1, 7)])
def test_unpacking_gives_back_the_packed_weight(dtype, n, k):
    """What the AMX path multiplies by: the weight as loaded, bit for bit (a bf16 row of odd k
    ends in half a 32-bit lane)."""
    _needs(dtype)
    kernel = cpu_linear._kernel(dtype)
    weight = torch.randn(n, k).to(dtype)
    packed = cpu_linear.aligned_empty(cpu_linear.packed_numel(n, k, dtype, kernel), dtype)
    kernel.pack(weight.data_ptr(), packed.data_ptr(), n, k)
    unpacked = torch.full((n, k), float("nan"), dtype=dtype)
    kernel.unpack(packed.data_ptr(), unpacked.data_ptr(), n, k)
    assert torch.equal(unpacked, weight)


@pytest.mark.parametrize("amx_from, unpacks", [(2, True), (100, False)])
def test_large_bf16_steps_on_amx_run_torchs_gemm_over_the_unpacked_experts(
        amx_from, unpacks, monkeypatch):
    """From ``_AMX_FROM_EXPERT_ROWS`` rows an expert (here 24 tokens x top 2 / 8 experts: 6),
    with AMX tiles, the step is ``moe.grouped_experts`` over the weights as loaded, to the bit;
    below, the panels as before."""
    _needs(torch.bfloat16)
    monkeypatch.setattr(cpu_experts.native, "has_amx", lambda: True)
    monkeypatch.setattr(cpu_experts, "_AMX_FROM_EXPERT_ROWS", amx_from)
    unpacked = []
    real = cpu_experts.PanelExperts.unpacked_linear
    monkeypatch.setattr(cpu_experts.PanelExperts, "unpacked_linear",
                        lambda self, *args: unpacked.append(args[:2]) or real(self, *args))
    experts = _experts(8, torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(24, HIDDEN, generator=gen).bfloat16()
    weights, ids = moe.route(torch.randn(24, 8, generator=gen), 2, True)
    out = cpu_experts.PanelExperts.build(experts).run(x, weights, ids)
    if unpacks:
        assert torch.equal(out, moe.grouped_experts(x, weights, ids, experts, fused.act_and_mul))
        assert {e for _, e in unpacked} == set(ids.flatten().tolist())
    else:
        assert torch.equal(out, _panel_reference(x, weights, ids, experts)) and not unpacked


def test_large_bf16_steps_stay_on_the_panels_where_those_run_on_amx_tiles(monkeypatch):
    """Both projections' depth a multiple of 32: the panels themselves run on the tiles, faster
    than torch's GEMM after unpacking, at any step."""
    _needs(torch.bfloat16)
    if cpu_linear.amx_tiles() is None:
        pytest.skip("no AMX tiles here (AMX-BF16 in the CPU and the build, and the kernel's "
                    "permission)")
    monkeypatch.setattr(cpu_experts, "_AMX_FROM_EXPERT_ROWS", 2)
    monkeypatch.setattr(cpu_experts.PanelExperts, "unpacked_linear",
                        lambda *args: pytest.fail("a projection was unpacked"))
    experts = _experts(8, torch.bfloat16, hidden=64, intermediate=32)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(24, 64, generator=gen).bfloat16()
    weights, ids = moe.route(torch.randn(24, 8, generator=gen), 2, True)
    out = cpu_experts.PanelExperts.build(experts).run(x, weights, ids)
    assert torch.equal(out, _panel_reference(x, weights, ids, experts))
