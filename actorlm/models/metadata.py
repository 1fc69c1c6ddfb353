"""The flattened description of one step's batch that every attention layer reads."""

from __future__ import annotations

from dataclasses import dataclass

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
