"""The flattened description of one step's batch that every attention layer reads, built once
per step by the backend (``KernelBackend.attention_metadata``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """All scheduled tokens of a step form one unpadded 1-D batch of T tokens from B requests.

    Request b owns tokens ``query_start_loc[b]:query_start_loc[b+1]``; they sit at the last
    ``q_len_b`` positions of its context of ``seq_lens[b]`` tokens (cached + new).
    """

    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    block_tables: torch.Tensor  # [B, max_num_blocks] int32, padded with 0
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    max_query_len: int
    max_seq_len: int
    plan: Any = None  # the backend's own plan of the step's attention

    @classmethod
    def build(cls, q_lens: Sequence[int], seq_lens: Sequence[int],
              block_ids: Sequence[Sequence[int]], block_size: int, device,
              plan: Callable | None = None) -> AttentionMetadata:
        """From the step's Python lists: request b computes the last ``q_lens[b]`` positions of
        its ``seq_lens[b]``-token context, stored in the blocks ``block_ids[b]``. ``plan``, if
        given, is called as ``plan(q_lens, seq_lens, block_ids, block_size, tables)`` with the
        block table and seq_lens tensors, and its result rides along."""
        slots, starts = [], [0]
        for q_len, seq_len, blocks in zip(q_lens, seq_lens, block_ids):
            slots += [blocks[p // block_size] * block_size + p % block_size
                      for p in range(seq_len - q_len, seq_len)]
            starts.append(starts[-1] + q_len)
        tables = (padded_block_table(block_ids, device),
                  torch.tensor(seq_lens, dtype=torch.int32, device=device))
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=tables[0],
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=tables[1],
            max_query_len=max(q_lens), max_seq_len=max(seq_lens),
            plan=None if plan is None else plan(q_lens, seq_lens, block_ids, block_size, tables))


def padded_block_table(block_ids: Sequence[Sequence[int]], device) -> torch.Tensor:
    """[B, longest] int32: row b is ``block_ids[b]``, padded with 0. Filled from one flat list
    of the real entries: padding B Python lists to the longest would cost a step B times the
    longest context's blocks (milliseconds for one 7,000-token request among 63 short ones)."""
    width = max(map(len, block_ids), default=0)
    if all(len(blocks) == width for blocks in block_ids):  # no padding (one request, say)
        return torch.tensor(block_ids, dtype=torch.int32).view(len(block_ids), width).to(device)
    lengths = torch.tensor([len(blocks) for blocks in block_ids], dtype=torch.int64)
    table = torch.zeros(len(block_ids), width, dtype=torch.int32)
    table[torch.arange(width) < lengths[:, None]] = torch.tensor(
        [block for blocks in block_ids for block in blocks], dtype=torch.int32)
    return table.to(device)
