"""Routed experts through the door (``KernelBackend.fused_moe``, both wings) against the oracle
(``reference.fused_moe_ref``), with the tolerance ``tolerance.experts_error`` derives: ragged
token counts, experts no token picks, top 1 to 3, renormalised or not, a hidden size that is
not a power of two, fp32 and bf16, the experts as stacked or as ``prepare_experts`` laid them
out. And the grouping itself: one pair of matmuls per expert
that has tokens, whatever the number of tokens."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_within, experts_error

from actorlm.kernels import Experts, moe, portable, select_backend
from actorlm.kernels.reference import fused_moe_ref

HIDDEN, INTERMEDIATE = 48, 24


def _inputs(num_tokens, num_experts, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * INTERMEDIATE, HIDDEN, generator=gen) * 0.2).to(dtype)
    down = (torch.randn(num_experts, HIDDEN, INTERMEDIATE, generator=gen) * 0.2).to(dtype)
    # each row's logits a shuffle of values 0.4 apart: no two experts tie, in bf16 either
    # (the oracle and the kernel then pick the same ones), and the softmax's weights differ
    order = torch.argsort(torch.rand(num_tokens, num_experts, generator=gen), dim=-1)
    jitter = torch.rand(num_tokens, num_experts, generator=gen) * 0.2
    logits = ((order.float() + jitter) * 0.4).to(dtype)
    return x, logits, gate_up, down


@pytest.mark.parametrize("wing", ["cpu", "triton"])
@pytest.mark.parametrize("prepared", [False, True], ids=["stacked", "prepared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "softmax"])
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [
    (1, 8, 2),  # a decode: two experts, six idle
    (3, 4, 1),
    (7, 8, 3),
    (37, 6, 2),  # more tokens than experts: every expert many rows
])
def test_the_wings_route_and_compute_as_the_oracle(wing, prepared, dtype, renormalize,
                                                   num_tokens, num_experts, top_k, monkeypatch):
    """(prepared: the experts laid out by ``prepare_experts``, the CPU's C++ kernel where it
    is built)"""
    monkeypatch.setenv("ACTORLM_ATTENTION_BACKEND", wing)
    backend = select_backend("cpu")
    x, logits, gate_up, down = _inputs(num_tokens, num_experts, dtype)
    experts = Experts(gate_up, down)
    if prepared:
        experts = backend.prepare_experts(experts)
    out = backend.fused_moe(x, logits, experts, top_k, renormalize)
    expected = fused_moe_ref(x, logits, gate_up, down, top_k, renormalize)
    assert out.dtype == dtype and out.shape == x.shape
    assert_within(out, expected, experts_error(x, logits, gate_up, down, top_k, renormalize,
                                               expected), f"{wing} {dtype}")


@pytest.mark.parametrize("wing", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens, num_experts, top_k", [(1, 8, 2), (37, 6, 2)])
def test_gpt_oss_experts_add_their_biases_around_the_clamped_swiglu(wing, dtype, num_tokens,
                                                                   num_experts, top_k,
                                                                   monkeypatch):
    """GPT-OSS's experts: biases on gate/up and on down, the clamped SwiGLU, its gate and up
    features past the clamp's +-7 (the projections scaled up); the biases and the clamp each
    move the output by more than the tolerance."""
    monkeypatch.setenv("ACTORLM_ATTENTION_BACKEND", wing)
    backend = select_backend("cpu")
    x, logits, gate_up, down = _inputs(num_tokens, num_experts, dtype, seed=3)
    gate_up = (gate_up.float() * 8).to(dtype)  # |g|, |up| up to ~20
    gen = torch.Generator().manual_seed(4)
    gate_up_bias = torch.randn(num_experts, 2 * INTERMEDIATE, generator=gen).to(dtype)
    down_bias = torch.randn(num_experts, HIDDEN, generator=gen).to(dtype)
    args = (x, logits, gate_up, down, top_k, True)
    experts = Experts(gate_up, down, "swiglu_oai", 0, gate_up_bias, down_bias)
    out = backend.fused_moe(x, logits, backend.prepare_experts(experts), top_k, True)
    expected = fused_moe_ref(*args, "swiglu_oai", gate_up_bias, down_bias)
    bound = experts_error(*args, expected, gate_up_bias=gate_up_bias, down_bias=down_bias,
                          swiglu_oai=True)
    assert_within(out, expected, bound, f"{wing} {dtype}")
    for unbiased, unclamped in (((None, None), False), ((gate_up_bias, down_bias), True)):
        other = fused_moe_ref(*args, "silu" if unclamped else "swiglu_oai", *unbiased)
        assert ((other.double() - expected.double()).abs() > bound).any()


def test_tokens_are_grouped_by_expert_one_pair_of_matmuls_per_expert_with_tokens():
    x, logits, gate_up, down = _inputs(40, 8, torch.float32, seed=1)
    rows_per_call = []

    def counting(gate_up_rows, activation):
        rows_per_call.append(gate_up_rows.shape[0])
        return portable.act_and_mul(gate_up_rows, activation)

    weights, ids = moe.route(logits, 2, True)
    out = moe.grouped_experts(x, weights, ids, Experts(gate_up, down), counting)
    # one call per expert some token picked, its rows all of that expert's tokens
    assert rows_per_call == torch.bincount(ids.flatten(), minlength=8)[
        torch.bincount(ids.flatten(), minlength=8) > 0].tolist()
    assert sum(rows_per_call) == 40 * 2
    torch.testing.assert_close(out, fused_moe_ref(x, logits, gate_up, down, 2, True),
                               atol=1e-5, rtol=0)


def test_routing_is_the_softmax_top_k_renormalized_or_not():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 2.5]])
    probs = logits.softmax(-1)
    weights, ids = moe.route(logits, 2, renormalize=False)
    assert ids.tolist() == [[1, 2], [0, 3]]
    torch.testing.assert_close(weights, probs.gather(-1, ids))
    weights, _ = moe.route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    torch.testing.assert_close(weights[0, 0] / weights[0, 1], probs[0, 1] / probs[0, 2])


def test_a_step_of_no_tokens_routes_nothing():
    x, logits, gate_up, down = _inputs(0, 4, torch.float32)
    out = select_backend("cpu").fused_moe(x, logits, Experts(gate_up, down), 2, True)
    assert out.shape == (0, HIDDEN)
