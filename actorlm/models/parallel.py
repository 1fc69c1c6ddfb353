"""Tensor parallelism (Megatron's layout): which slice of each layer a rank holds, and the
collectives that join the slices.

Every rank runs the same forward over the same tokens. Column-parallel layers (qkv, gate/up,
the LM head) split their output features: each rank computes its heads, its share of the MLP,
its slice of the vocabulary. Row-parallel layers (o_proj, down_proj) split their input
features, so each rank holds a partial sum of the full output: one ``all_reduce`` per layer
joins them. Routed experts split every expert's intermediate features the same way (gate/up
rows, down columns), so a mixture of experts is joined by one ``all_reduce`` too; with
``expert_parallel`` (``--enable-expert-parallel``, ``expert_parallel.py``) a rank holds whole
experts instead, a 1/N share of them, and the same ``all_reduce`` sums the ranks' experts. The
embedding splits the vocabulary: a rank embeds only the tokens in its slice (zeros elsewhere)
and an ``all_reduce`` sums the slices. Only rank 0 samples, from logits
gathered onto it.

With ``size == 1`` there is no parallelism: the model builds its plain layers and calls none
of the functions here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group: rank ``rank`` of ``size``;
    ``expert_parallel``: the routed experts placed whole on the ranks, not split."""

    rank: int = 0
    size: int = 1
    expert_parallel: bool = False

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside 0..{self.size - 1}")

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    @property
    def is_driver(self) -> bool:
        """Rank 0: the one that gets the full logits, samples and answers the step."""
        return self.rank == 0

    def split(self, total: int) -> tuple[int, int]:
        """(start, length) of this rank's equal share of ``total`` (a multiple of ``size``)."""
        share = total // self.size
        return self.rank * share, share

    def local_experts(self, num_experts: int) -> tuple[int, int]:
        """(first, count) of the routed experts this rank holds: its share of them under
        expert parallelism, else every one (each split by ``expert_features``)."""
        return self.split(num_experts) if self.expert_parallel else (0, num_experts)

    def expert_features(self, intermediate_size: int) -> int:
        """How many of each held expert's intermediate features this rank holds: all of them
        under expert parallelism, else its share."""
        return intermediate_size if self.expert_parallel else intermediate_size // self.size


def num_kv_heads_per_rank(num_kv_heads: int, size: int) -> int:
    """KV heads each rank holds: its share, or one replicated head when there are fewer KV
    heads than ranks (each rank then holds the one its query heads read)."""
    return max(1, num_kv_heads // size)


def first_kv_head(tp: TensorParallel, num_heads: int, num_kv_heads: int) -> int:
    """The first of the model's ``num_kv_heads`` KV heads that this rank's query heads read
    (with fewer KV heads than ranks, the one it holds a copy of): where its k and v rows
    start in the whole k and v projections."""
    return tp.rank * (num_heads // tp.size) * num_kv_heads // num_heads


def check_tensor_parallel(name: str, num_heads: int, num_kv_heads: int,
                          intermediate_size: int | Mapping[str, int], size: int) -> None:
    """Raise ValueError, naming the flag, if the model ``name`` cannot be split ``size`` ways.
    ``intermediate_size``: the MLP's, or each MLP's by what the message calls it (a dense
    MLP's, routed experts', a shared expert's: ``moe_families.intermediate_sizes``)."""
    if size == 1:
        return
    flag = f"--tensor-parallel-size {size}"
    if num_heads % size:
        raise ValueError(f"{flag} does not divide {name}'s {num_heads} attention heads; "
                         f"use a divisor of {num_heads}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"{flag} neither divides {name}'s {num_kv_heads} KV heads nor is a "
                         f"multiple of them; use a divisor or a multiple of {num_kv_heads}")
    sizes = intermediate_size if isinstance(intermediate_size, Mapping) else \
        {"MLP intermediate size": intermediate_size}
    for what, features in sizes.items():
        if features % size:
            raise ValueError(f"{flag} does not divide {name}'s {what} {features}; use a "
                             f"divisor of {features}")


def init_tensor_parallel(rank: int, size: int, init_method: str,
                         device: torch.device) -> TensorParallel:
    """Join the process group of ``size`` ranks at ``init_method`` (``tcp://host:port``):
    gloo on a CPU, nccl on CUDA. Once per worker process, before its runner is built."""
    tp = TensorParallel(rank, size)
    if size > 1:
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(rank_gpu(rank, torch.cuda.device_count()))
        torch.distributed.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", init_method=init_method,
            rank=rank, world_size=size)
    return tp


def rank_gpu(rank: int, visible: int) -> int:
    """The GPU a rank runs on, of the ``visible`` ones this process sees: its own where it
    sees every rank's (worker processes on one node), the one it sees under Ray (which gives
    each rank's actor one GPU of its own)."""
    if visible < 1:
        raise RuntimeError(f"tensor-parallel rank {rank} sees no GPU")
    return rank % visible


def check_initialised(tp: TensorParallel) -> None:
    """Raise RuntimeError unless this process has joined ``tp``'s group as ``tp.rank``."""
    if not tp.is_parallel:
        return
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"--tensor-parallel-size {tp.size}: rank {tp.rank}'s runner needs "
                           f"torch.distributed; call init_tensor_parallel in its process first")
    if (dist.get_rank(), dist.get_world_size()) != (tp.rank, tp.size):
        raise RuntimeError(f"--tensor-parallel-size {tp.size}: this process is rank "
                           f"{dist.get_rank()} of {dist.get_world_size()}, not rank {tp.rank} "
                           f"of {tp.size}")


def all_reduce(tp: TensorParallel, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum (or ``op``: "max") ``x`` over the ranks, in place; returns it."""
    if tp.is_parallel:
        torch.distributed.all_reduce(x, getattr(torch.distributed.ReduceOp, op.upper()))
    return x


def gather_last_dim(tp: TensorParallel, x: torch.Tensor) -> torch.Tensor | None:
    """Rank 0: every rank's ``x`` [..., n] joined in rank order, [..., size * n]; others None."""
    if not tp.is_parallel:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp.size)] if tp.is_driver else None
    torch.distributed.gather(x, parts, dst=0)
    return torch.cat(parts, dim=-1) if tp.is_driver else None
