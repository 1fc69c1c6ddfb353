"""fused_moe (Triton, interpreted on the CPU) against the float64 oracle
(``reference.fused_moe_ref``) and the torch grouped path (``kernels/moe.py``), and the slots'
block layout (``moe_align.align_slots``) it runs over.

Tolerances:

- the oracle: ``tolerance.experts_error``, per element — the kernel does what that bound
  assumes (fp32 sums, every intermediate rounded to x's dtype, the weighted products rounded
  once, k - 1 roundings of the sum). It assumes SiLU; the GeLU case is held to the torch path.
- the torch path: the same roundings, only each matmul's fp32 sum in another order, so fp32
  within 1e-5 (outputs are O(1)); bf16 within 1e-2 (an intermediate rounded to the neighbouring
  bf16 value, carried through) and a cosine similarity of at least 0.9999.
"""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_within, experts_error

from actorlm.kernels import Experts, moe
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
