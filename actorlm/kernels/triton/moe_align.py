"""The routed slots laid out for the grouped GEMM of ``fused_moe.py``, in torch ops.

A step of T tokens routed to ``top_k`` experts each has T * top_k slots, slot s belonging to
token s // top_k. The GEMM runs one program per ``block_m`` rows of a single expert, so the
slots on this rank's experts are sorted by expert (in slot order within one) and each
expert's group is padded to a multiple of ``block_m``; a slot on another rank's expert is left
out (it adds zero). This is vLLM's ``moe_align_block_size``, without a host sync: the number of
blocks the grid needs is bounded on the host (each expert with slots pads at most one partial
block), and the blocks past the last real one are marked to run nothing.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton


class SlotBlocks(NamedTuple):
    """``sorted_slots`` [num_blocks * block_m] int32: the slot of each GEMM row, grouped by
    expert, each group padded with ``num_slots`` (a row to skip); ``block_experts``
    [num_blocks] int32: each block's local expert, ``num_experts`` for the blocks past the
    last group (they run nothing)."""

    sorted_slots: torch.Tensor
    block_experts: torch.Tensor


def max_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """The most blocks ``align_slots`` can fill: whole blocks of all the slots, plus at most
    one partial block per expert that has any."""
    return triton.cdiv(num_slots, block_m) + min(num_experts, num_slots)


def align_slots(slot_experts: torch.Tensor, num_experts: int, block_m: int) -> SlotBlocks:
    """``slot_experts`` [num_slots] int64: each slot's local expert, ``num_experts`` where the
    expert is another rank's -> the slots grouped by expert in blocks of ``block_m``."""
    num_slots = slot_experts.numel()
    device = slot_experts.device
    num_blocks = max_blocks(num_slots, num_experts, block_m)
    # a scatter-add, not bincount: bincount on CUDA reads the maximum back to the host
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, slot_experts, torch.ones_like(slot_experts))
    counts = counts[:num_experts]  # [E]: the other ranks' slots dropped
    blocks_per_expert = (counts + block_m - 1) // block_m
    block_ends = blocks_per_expert.cumsum(0)  # [E]
    block_experts = torch.searchsorted(block_ends, torch.arange(num_blocks, device=device),
                                       right=True)  # [num_blocks]; num_experts past the end
    order = slot_experts.argsort(stable=True)  # the slots by expert, the other ranks' last
    grouped = slot_experts[order]
    held = grouped < num_experts
    expert = grouped.clamp(max=num_experts - 1)
    rank_in_group = torch.arange(num_slots, device=device) - (counts.cumsum(0) - counts)[expert]
    row = (block_ends - blocks_per_expert)[expert] * block_m + rank_in_group
    num_rows = num_blocks * block_m
    row = row.where(held, num_rows)  # the other ranks' slots go to a row past the end
    sorted_slots = torch.full((num_rows + 1,), num_slots, dtype=torch.int32, device=device)
    sorted_slots.scatter_(0, row, order.to(torch.int32))
    return SlotBlocks(sorted_slots[:num_rows], block_experts.to(torch.int32))
