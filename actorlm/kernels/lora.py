"""LoRA deltas of a batch that mixes adapters, in torch (any device): shrink, then expand, per
group of tokens that share an adapter, as punica's grouped kernels do. This is the reference
the CPU and Triton kernels are tested against.

A step's tokens each run with one adapter slot or none (the base model). ``LoRAMapping`` groups
them once per step: each slot's rows, as a slice where they are one run (a request's tokens
are consecutive, so a lone request's are) and as an index tensor otherwise, and keeps each
token's slot as a tensor for the kernels that walk the rows themselves. ``add_lora`` then adds
each group's ``x @ A.T @ B`` to the layer's output: two small GEMMs a group, the rank wide, so
the cost grows with the tokens that have an adapter and the number of distinct adapters, not
with the slots in the table.

A layer's table (``LoRATable``) holds B transposed, [slots, rank, out]: the expand is then
``rank`` axpys over contiguous output rows (``y[o0:o1] += t[k] * B[k, o0:o1]``), which a CPU
vectorises along the outputs and a GPU reads coalesced. A merged layer (q, k and v; gate and
up) holds its parts' adapters side by side, B block-diagonal (``lora_adapter``):
``out_parts`` says which output rows each part's share of the rank writes, so a kernel may
skip the zero blocks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch


class LoRATable(NamedTuple):
    """One adapted layer's slots: slot s adds ``x @ a[s].T @ b[s]`` (its scale folded into b;
    zero where the slot's adapter is smaller or absent). With parts, part p of ``out_parts``
    owns rank columns ``[p r, (p + 1) r)`` (r = rank / parts) and the next ``out_parts[p]``
    output rows; B is zero elsewhere."""

    a: torch.Tensor  # [slots, rank, in]
    b: torch.Tensor  # [slots, rank, out]
    out_parts: tuple[int, ...]  # output rows of each part, summing to out

    @property
    def rank(self) -> int:
        return self.a.shape[1]


class LoRASegments(NamedTuple):
    """The step's rows with an adapter grouped by slot, for kernels that launch once over all
    of them (on the model's device): group g is ``rows[starts[g]:starts[g + 1]]``, of slot
    ``slots[g]``."""

    rows: torch.Tensor  # [n] int32, row indices, group after group
    starts: torch.Tensor  # [G + 1] int32
    slots: torch.Tensor  # [G] int32
    max_rows: int  # the largest group's rows (the host knows it: no sync to size a grid)


@dataclass(frozen=True)
class LoRAMapping:
    """The step's token groups: ``(slot, rows)`` per slot that some token uses, and
    ``token_slots`` [T] int32, each token's slot (-1: none), on the model's device."""

    groups: list[tuple[int, slice | torch.Tensor]]
    token_slots: torch.Tensor | None = None
    members: tuple[tuple[int, ...], ...] = field(default=(), compare=False, repr=False)

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
        slots = torch.tensor(token_slots, dtype=torch.int32, device=device) if groups else None
        return cls(groups, slots, tuple(tuple(members) for members in rows.values()))

    @functools.cached_property
    def segments(self) -> LoRASegments:
        """The groups as ``LoRASegments``, built at the first call of the step (by its first
        adapted layer) and kept for the others."""
        device = self.token_slots.device
        sizes = [len(members) for members in self.members]
        rows = [row for members in self.members for row in members]
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + size)
        # one copy to the device for the three
        packed = torch.tensor(rows + starts + [slot for slot, _ in self.groups],
                              dtype=torch.int32).to(device)
        n, g = len(rows), len(sizes)
        return LoRASegments(packed[:n], packed[n:n + g + 1], packed[n + g + 1:], max(sizes))


def add_lora(y: torch.Tensor, x: torch.Tensor, table: LoRATable,
             mapping: LoRAMapping) -> torch.Tensor:
    """``y [T, out] += x [T, in] @ table.a[s].T @ table.b[s]`` for the rows of each slot s of
    ``mapping``, each product rounded to the dtype as torch's matmuls round them. Returns y."""
    for slot, rows in mapping.groups:
        delta = (x[rows] @ table.a[slot].T) @ table.b[slot]  # shrink, then expand
        if isinstance(rows, slice):
            y[rows] += delta
        else:
            y.index_add_(0, rows, delta)
    return y
