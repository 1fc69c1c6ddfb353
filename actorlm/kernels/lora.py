"""LoRA deltas of a batch that mixes adapters, in torch (any device): shrink, then expand, per
group of tokens that share an adapter, as punica's grouped kernels do.

A step's tokens each run with one adapter slot or none (the base model). ``LoRAMapping`` groups
them once per step: each slot's rows, as a slice where they are one run (a request's tokens
are consecutive, so a lone request's are) and as an index tensor otherwise. ``add_lora`` then
adds each group's ``x @ A.T @ B.T`` to the layer's output: two small GEMMs a group, the rank
wide, so the cost grows with the tokens that have an adapter and the number of distinct
adapters, not with the slots in the table.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


class LoRAMapping(NamedTuple):
    """The step's token groups: ``(slot, rows)`` per slot that some token uses."""

    groups: list[tuple[int, slice | torch.Tensor]]

    @classmethod
    def build(cls, token_slots: Sequence[int], device) -> LoRAMapping:
        """From each token's slot (-1: no adapter)."""
        rows: dict[int, list[int]] = {}
        for row, slot in enumerate(token_slots):
            if slot >= 0:
                rows.setdefault(slot, []).append(row)
        groups = []
        for slot, members in rows.items():
            first, last = members[0], members[-1]
            if last - first + 1 == len(members):  # one run: a view, no gather
                groups.append((slot, slice(first, last + 1)))
            else:
                groups.append((slot, torch.tensor(members, dtype=torch.int64, device=device)))
        return cls(groups)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             mapping: LoRAMapping) -> torch.Tensor:
    """``y [T, out] += x [T, in] @ lora_a[s].T @ lora_b[s].T`` for the rows of each slot s of
    ``mapping``; ``lora_a`` [slots, rank, in], ``lora_b`` [slots, out, rank] (a slot's adapter
    zero-padded to the table's rank, its scale in B). Returns y."""
    for slot, rows in mapping.groups:
        delta = (x[rows] @ lora_a[slot].T) @ lora_b[slot].T  # shrink, then expand
        if isinstance(rows, slice):
            y[rows] += delta
        else:
            y.index_add_(0, rows, delta)
    return y
