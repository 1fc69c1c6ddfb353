"""fused_moe (Triton, interpreted on the CPU) against the float64 oracle
(``reference.fused_moe_ref``) and the torch grouped path (``kernels/moe.py``), and the slots'
block layout (``moe_align.align_slots``) it runs over.

Tolerances:

- the oracle: ``tolerance.experts_error``, per element — the kernel does what that bound
  assumes (fp32 sums, every intermediate rounded to x's dtype, the weighted products rounded
  once, k - 1 roundings of the sum). It assumes SiLU; the GeLU case is held to the torch path.
  GPT-OSS's experts (biases, ``swiglu_oai``) are held to the same bound, which covers them.
- the torch path: the same roundings, only each matmul's fp32 sum in another order, so fp32
  within 1e-5 (outputs are O(1)); bf16 within 1e-2 (an intermediate rounded to the neighbouring
  bf16 value, carried through) and a cosine similarity of at least 0.9999.
"""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_within, experts_error

from actorlm.kernels import Experts, moe
from actorlm.kernels.backend import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from actorlm.kernels.reference import fused_moe_ref
from actorlm.kernels.triton.activation import act_and_mul
from actorlm.kernels.triton.fused_moe import fused_moe
from actorlm.kernels.triton.moe_align import align_slots, max_blocks

HIDDEN, INTERMEDIATE, NUM_EXPERTS = 64, 32, 8
DTYPES = [torch.float32, torch.bfloat16]
TORCH_PATH_ATOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _inputs(num_tokens, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    # scaled so that every intermediate is O(1)
    gate_up = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=gen) * HIDDEN ** -0.5
    down = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=gen) * INTERMEDIATE ** -0.5
    # each row's logits a shuffle of values 0.4 apart: no ties, in bf16 either, so the oracle
    # picks the kernel's experts
    order = torch.argsort(torch.rand(num_tokens, NUM_EXPERTS, generator=gen), dim=-1)
    jitter = torch.rand(num_tokens, NUM_EXPERTS, generator=gen) * 0.2
    logits = ((order.float() + jitter) * 0.4).to(dtype)
    return x, logits, gate_up.to(dtype), down.to(dtype)


def _assert_near_torch_path(out, x, logits, experts, top_k, renormalize):
    expected = moe.fused_moe(x, logits, experts, top_k, renormalize, act_and_mul)
    torch.testing.assert_close(out, expected, atol=TORCH_PATH_ATOL[x.dtype], rtol=0)
    cosine = torch.cosine_similarity(out.double().flatten(), expected.double().flatten(), dim=0)
    assert cosine >= 0.9999, float(cosine)


def _assert_near_oracle(out, x, logits, gate_up, down, top_k, renormalize):
    expected = fused_moe_ref(x, logits, gate_up, down, top_k, renormalize)
    assert out.dtype == x.dtype and out.shape == x.shape
    assert_within(out, expected, experts_error(x, logits, gate_up, down, top_k, renormalize,
                                               expected), str(x.dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens, top_k, renormalize", [
    (1, 2, True),  # a decode: two experts, six idle
    (5, 1, False),
    (33, 2, False),  # every expert several rows
    (33, 2, True),
])
def test_routes_and_computes_as_the_oracle_and_the_torch_path(dtype, num_tokens, top_k,
                                                              renormalize):
    x, logits, gate_up, down = _inputs(num_tokens, dtype)
    out = fused_moe(x, logits, Experts(gate_up, down), top_k, renormalize)
    _assert_near_oracle(out, x, logits, gate_up, down, top_k, renormalize)
    _assert_near_torch_path(out, x, logits, Experts(gate_up, down), top_k, renormalize)


def test_an_expert_with_more_rows_than_a_block():
    x, logits, gate_up, down = _inputs(40, torch.bfloat16, seed=1)
    logits[:, 3] += 10  # every token's first expert: 40 rows, three 16-row blocks
    out = fused_moe(x, logits, Experts(gate_up, down), 2, True)
    _assert_near_oracle(out, x, logits, gate_up, down, 2, True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_a_ranks_share_of_the_experts_computes_its_part_and_zeros_for_the_others(dtype):
    first, num_held = 2, 4  # experts 2..5 of the router's 8
    x, logits, gate_up, down = _inputs(33, dtype, seed=2)
    logits[0, 6:] += 10  # token 0: both slots on another rank's experts
    held = slice(first, first + num_held)
    experts = Experts(gate_up[held].contiguous(), down[held].contiguous(), "silu", first)
    out = fused_moe(x, logits, experts, 2, True)
    assert torch.equal(out[0], torch.zeros(HIDDEN, dtype=dtype))
    # the oracle over all the experts, the others' weights zero: they add exactly zero
    others = torch.ones(NUM_EXPERTS, dtype=torch.bool)
    others[held] = False
    gate_up[others], down[others] = 0, 0
    _assert_near_oracle(out, x, logits, gate_up, down, 2, True)
    _assert_near_torch_path(out, x, logits, experts, 2, True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_gelu_tanh_experts_as_the_torch_path(dtype):
    x, logits, gate_up, down = _inputs(5, dtype, seed=3)
    experts = Experts(gate_up, down, "gelu_tanh")
    out = fused_moe(x, logits, experts, 2, False)
    _assert_near_torch_path(out, x, logits, experts, 2, False)
    expected = fused_moe_ref(x, logits, gate_up, down, 2, False, "gelu_tanh")
    torch.testing.assert_close(out, expected, atol=TORCH_PATH_ATOL[dtype], rtol=0)


def _oai_experts(gate_up, down, biases, seed):
    """GPT-OSS-like experts over ``_inputs``' weights: swiglu_oai and the ``biases`` named
    ("gate_up", "down" or both), the gate/up ones 4 sigma wide so that gate and up pass the
    clamps' limits (+-7) in a few percent of the features (up on either side)."""
    gen = torch.Generator().manual_seed(seed)
    gate_up_bias = 4 * torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, generator=gen)
    down_bias = 0.5 * torch.randn(NUM_EXPERTS, HIDDEN, generator=gen)
    return Experts(gate_up, down, "swiglu_oai", 0,
                   gate_up_bias.to(gate_up.dtype) if "gate_up" in biases else None,
                   down_bias.to(gate_up.dtype) if "down" in biases else None)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_tokens, top_k, renormalize, biases", [
    (1, 2, True, ("gate_up", "down")),  # a decode
    (33, 2, False, ("gate_up", "down")),
    (33, 4, True, ("gate_up",)),  # a tensor-parallel rank without the down bias
    (5, 1, False, ("down",)),
])
def test_biased_swiglu_oai_experts_compute_as_the_oracle(dtype, num_tokens, top_k, renormalize,
                                                        biases):
    x, logits, gate_up, down = _inputs(num_tokens, dtype, seed=5)
    experts = _oai_experts(gate_up, down, biases, seed=num_tokens)
    out = fused_moe(x, logits, experts, top_k, renormalize)
    ref_args = (x, logits, gate_up, down, top_k, renormalize)
    expected = fused_moe_ref(*ref_args, "swiglu_oai", experts.gate_up_bias, experts.down_bias)
    bound = experts_error(*ref_args, expected, gate_up_bias=experts.gate_up_bias,
                          down_bias=experts.down_bias, swiglu_oai=True)
    assert out.dtype == dtype and out.shape == x.shape
    assert_within(out, expected, bound, f"swiglu_oai experts {dtype}")
    # each bias, and the activation, moves the output past the bound: dropping one fails
    variants = [("silu", experts.gate_up_bias, experts.down_bias)]
    if experts.gate_up_bias is not None:
        variants.append(("swiglu_oai", None, experts.down_bias))
    if experts.down_bias is not None:
        variants.append(("swiglu_oai", experts.gate_up_bias, None))
    for variant in variants:
        other = fused_moe_ref(*ref_args, *variant)
        assert ((other.double() - expected.double()).abs() > bound).any(), variant[0]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_a_ranks_share_of_biased_experts_reads_its_own_biases(dtype):
    first, num_held = 2, 4  # experts 2..5 of the router's 8
    x, logits, gate_up, down = _inputs(33, dtype, seed=6)
    everyone = _oai_experts(gate_up, down, ("gate_up", "down"), seed=6)
    held = slice(first, first + num_held)
    experts = Experts(*(t[held].contiguous() for t in (gate_up, down)), "swiglu_oai", first,
                      *(t[held].contiguous() for t in (everyone.gate_up_bias, everyone.down_bias)))
    out = fused_moe(x, logits, experts, 2, True)
    # the oracle over all the experts, the others' weights and biases zero: they add zero
    others = torch.ones(NUM_EXPERTS, dtype=torch.bool)
    others[held] = False
    for t in (gate_up, down, everyone.gate_up_bias, everyone.down_bias):
        t[others] = 0
    ref_args = (x, logits, gate_up, down, 2, True)
    expected = fused_moe_ref(*ref_args, "swiglu_oai", everyone.gate_up_bias, everyone.down_bias)
    assert_within(out, expected, experts_error(
        *ref_args, expected, gate_up_bias=everyone.gate_up_bias, down_bias=everyone.down_bias,
        swiglu_oai=True), str(dtype))


def test_a_step_of_no_tokens_routes_nothing():
    x, logits, gate_up, down = _inputs(0, torch.float32)
    assert fused_moe(x, logits, Experts(gate_up, down), 2, True).shape == (0, HIDDEN)


def test_align_slots_puts_each_held_slot_once_in_blocks_of_one_expert():
    gen = torch.Generator().manual_seed(4)
    num_experts, block_m = 5, 4
    # 5 local experts, 5 standing for another rank's; expert 1 has no slot
    slot_experts = torch.tensor([0, 2, 3, 4] * 3 + [5] * 4 + [2] * 6)
    slot_experts = slot_experts[torch.randperm(slot_experts.numel(), generator=gen)]
    num_slots = slot_experts.numel()
    blocks = align_slots(slot_experts, num_experts, block_m)
    num_blocks = max_blocks(num_slots, num_experts, block_m)
    assert blocks.sorted_slots.shape == (num_blocks * block_m,)
    rows = blocks.sorted_slots.view(num_blocks, block_m).long()
    used = blocks.block_experts < num_experts
    # the blocks in ascending expert order, the unused ones last
    assert blocks.block_experts[used].tolist() == [0, 2, 2, 2, 3, 4]
    assert not used[used.sum():].any()
    assert (rows[~used] == num_slots).all()
    real = rows[used]
    is_slot = real < num_slots
    # each block's slots its expert's, ascending; every held slot once, the others' dropped
    assert (slot_experts[real[is_slot]] == blocks.block_experts[used].long()
            .repeat_interleave(block_m).view(-1, block_m)[is_slot]).all()
    held = (slot_experts < num_experts).nonzero().flatten()
    assert sorted(real[is_slot].tolist()) == held.tolist()
    for row, keep in zip(real, is_slot):
        assert row[keep].tolist() == sorted(row[keep].tolist())
