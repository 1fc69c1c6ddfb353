"""A decoder layer's mixture of experts, in place of its dense MLP (Qwen3-MoE, Mixtral,
Qwen2-MoE, OLMoE; ``moe_families.py`` says which layers and how they route).

A router (a linear layer, [E, H]) scores every expert for each token; the backend's
``fused_moe`` sends each token to its ``top_k`` experts and sums their outputs, weighted by the
router's softmax. Qwen2-MoE adds a shared expert, a dense MLP every token takes, scaled by
``sigmoid(shared_expert_gate(x))``.

The experts' weights are held stacked, one tensor per projection — gate/up [E, 2I, H] (each
expert's rows [gate | up]) and down [E, H, I] — as transformers holds them in memory; a
checkpoint's per-expert tensors (``experts.{e}.gate_proj.weight`` …) are copied into their
rows as they load (``expert_weights.py``). Tensor-parallel: each rank holds its share of every
expert's intermediate features (and of the shared expert's), so the block's output is a
partial sum on each rank, joined by one all-reduce, as a dense MLP's is. Expert-parallel
(``expert_parallel.py``): each rank holds its share of the experts, whole, which the backend
runs as experts ``first_expert`` on; the slots routed elsewhere add nothing, and the same
all-reduce sums the ranks' experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from actorlm.kernels import Experts, KernelBackend
from actorlm.models.layers import Linear
from actorlm.models.parallel import TensorParallel, all_reduce


@dataclass(frozen=True)
class MoeSpec:
    """A layer's routed experts, as its config says (whole sizes, before a split)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # the top-k weights divided by their sum (Mixtral; norm_topk_prob)
    shared_intermediate_size: int | None = None  # Qwen2-MoE's shared expert


class RoutedExperts(nn.Module):
    """The projections of this rank's experts (``num_experts`` of them from ``first_expert``:
    all, or its share under expert parallelism), stacked: ``intermediate_size`` features of
    each (this rank's share, or all under expert parallelism)."""

    def __init__(self, spec: MoeSpec, hidden_size: int, activation: str, dtype, device,
                 tp: TensorParallel):
        super().__init__()
        self.first_expert, self.num_experts = tp.local_experts(spec.num_experts)
        self.intermediate_size = size = tp.expert_features(spec.intermediate_size)
        self.activation = activation
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * size, hidden_size,
                                                     dtype=dtype, device=device), False)
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, hidden_size, size,
                                                  dtype=dtype, device=device), False)
        self.dtype = dtype
        self.prepared = None  # the backend's layout of the experts, once they are loaded

    def prepare(self, backend: KernelBackend) -> None:
        """Once loaded: the experts laid out by the backend; where it made its own copy, the
        stacked weights go (the model holds each weight once)."""
        plain = Experts(self.gate_up_proj, self.down_proj, self.activation, self.first_expert)
        self.prepared = backend.prepare_experts(plain)
        if self.prepared is not plain:
            self.gate_up_proj = self.down_proj = None

    @property
    def stacked(self):
        """What the backend's ``fused_moe`` takes: the prepared experts, or the stacked ones."""
        if self.prepared is not None:
            return self.prepared
        return Experts(self.gate_up_proj, self.down_proj, self.activation, self.first_expert)


class SparseMoeBlock(nn.Module):
    """Router, routed experts and (Qwen2-MoE) a gated shared expert: ``shared_expert`` is a
    dense MLP that does not all-reduce its output, since the block reduces once for both."""

    def __init__(self, spec: MoeSpec, hidden_size: int, activation: str,
                 backend: KernelBackend, dtype, device, tp: TensorParallel,
                 shared_expert: nn.Module | None = None):
        super().__init__()
        self.backend, self.tp, self.spec = backend, tp, spec
        self.gate = Linear(hidden_size, spec.num_experts, False, dtype, device)  # every rank: all
        self.experts = RoutedExperts(spec, hidden_size, activation, dtype, device, tp)
        self.shared_expert = shared_expert
        self.shared_expert_gate = None if shared_expert is None else \
            Linear(hidden_size, 1, False, dtype, device)

    def forward(self, x):
        # x: [T, H] -> router logits [T, E] (every expert's) -> [T, H] (a partial sum on
        # each rank)
        out = self.backend.fused_moe(x, self.gate(x), self.experts.stacked, self.spec.top_k,
                                     self.spec.renormalize)
        if self.shared_expert is not None:
            # the gate [T, 1] is the same on every rank, so it may scale the partial sums
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return all_reduce(self.tp, out)
