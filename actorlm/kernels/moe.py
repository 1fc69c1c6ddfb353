"""Routed experts in torch ops, on any device (``KernelBackend.fused_moe``): the CPU wing's path
where its experts are not packed (and, on AMX tiles, for packed experts' large steps), and the
routing (``route``) that every path shares.

A step's tokens are grouped by expert, not looped over: the (token, expert) pairs are sorted by
expert, each expert with tokens runs its gate/up and down projections once over all of its rows,
and the rows go back to their tokens. So a step costs one pair of matmuls per expert it touches,
whatever its number of tokens (a decode step of one token: ``top_k`` pairs; a long prefill: at
most one pair per expert).

Under expert parallelism the experts are one rank's share (``Experts.first_expert`` on): the
slots routed to the others are left out of the groups and add zero, so the rank's result is
its part of the sum, which the model's all-reduce completes.

Experts kept in GGUF blocks run the same groups through linear layers the backend prepared
over each expert's blocks (``LinearExperts``): a group's rows call its own expert's layers, so
a decode step reads the blocks of the ``top_k`` experts it routes to and no others.

Each token's expert outputs are weighted in fp32, rounded to the dtype and summed in ascending
expert order, as transformers' loop over the experts adds them (Mixtral's bits; the Qwen and
OLMoE layers round the weight to the dtype before the product, which differs only in bf16, by
at most an ulp of the product).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from actorlm.kernels import portable
from actorlm.kernels.backend import Experts, check_activation


def route(router_logits: torch.Tensor, top_k: int,
          renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, expert ids [T, k] int64): each token's ``top_k`` experts by the
    softmax of its router logits [T, E] in fp32, their probabilities divided by their sum
    with ``renormalize``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    experts: Experts | LinearExperts,
                    act_and_mul: Callable = portable.act_and_mul) -> torch.Tensor:
    """sum over j of weights[t, j] * expert ids[t, j] (x[t]) for each token: x [T, H], weights
    and ids [T, k] (the router's expert ids) -> [T, H], a slot on an expert that ``experts``
    does not hold adding nothing. ``act_and_mul`` is the wing's (gate_up [n, 2I] -> [n, I])."""
    check_activation(experts.activation)
    num_tokens, top_k = ids.shape
    num_experts = len(experts.gate_up)
    # each token's experts in ascending order, so that its slot j holds its j-th smallest
    ids, by_expert = ids.sort(dim=-1)
    weights = weights.gather(-1, by_expert)
    flat_ids = ids.flatten() - experts.first_expert  # [T k]: slot s belongs to token s // k
    # another rank's experts: one group past the held ones, which runs nothing
    flat_ids = flat_ids.where((flat_ids >= 0) & (flat_ids < num_experts), num_experts)
    order = flat_ids.argsort(stable=True)  # the slots, grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()  # one sync a layer
    held = order[:num_tokens * top_k - counts[num_experts]]  # the slots on held experts
    rows = x[held // top_k]  # [n, H]: each slot's token, grouped by expert
    slot_weights = weights.flatten()[held, None]  # [n, 1] fp32
    out = torch.empty_like(rows)
    gate_up_bias, down_bias = experts.gate_up_bias, experts.down_bias
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count == 0:
            continue
        end = start + count
        projected = _project(experts.gate_up[expert], rows[start:end],
                             None if gate_up_bias is None else gate_up_bias[expert])
        hidden = act_and_mul(projected, experts.activation)  # [n, I]
        # the product in fp32 (the weights' dtype), rounded to x's dtype by the copy
        out[start:end] = _project(experts.down[expert], hidden,
                                  None if down_bias is None else down_bias[expert]) * \
            slot_weights[start:end]
        start = end
    slots = x.new_zeros(num_tokens * top_k, x.shape[1])
    slots[held] = out  # back in token order: [T k, H]
    slots = slots.view(num_tokens, top_k, -1)
    total = slots[:, 0]
    for j in range(1, top_k):  # in ascending expert order, each sum rounded to the dtype
        total = total + slots[:, j]
    return total.contiguous()


def _project(weight: torch.Tensor | Callable, rows: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows [n, in] -> [n, out] through an expert's weight [out, in] or its prepared layer,
    plus its bias [out] where it has one."""
    if not callable(weight):
        return F.linear(rows, weight, bias)
    return weight(rows) if bias is None else weight(rows) + bias


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, experts: Experts | LinearExperts,
              top_k: int, renormalize: bool,
              act_and_mul: Callable = portable.act_and_mul) -> torch.Tensor:
    """``KernelBackend.fused_moe`` in torch ops: x [T, H], router_logits [T, E] -> [T, H]."""
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    weights, ids = route(router_logits, top_k, renormalize)
    return grouped_experts(x, weights, ids, experts, act_and_mul)


class LinearExperts:
    """Experts in GGUF blocks (``Experts.is_quantized``) as a backend runs them: each expert's
    gate/up and down prepared once by the backend's ``prepare_linear`` (its quantized linear
    kernel), the step's rows grouped by expert as for floats. ``__call__`` is
    ``KernelBackend.fused_moe`` over them, with the wing's ``act_and_mul``."""

    def __init__(self, experts: Experts, prepare_linear: Callable, act_and_mul: Callable):
        check_activation(experts.activation)
        self.gate_up = [prepare_linear(parts, None) for parts in experts.gate_up]
        self.down = [prepare_linear(weight, None) for weight in experts.down]
        self.activation, self.first_expert = experts.activation, experts.first_expert
        self.gate_up_bias, self.down_bias = experts.gate_up_bias, experts.down_bias
        self.num_experts, self.intermediate = len(self.down), experts.down[0].shape[1]
        self.act_and_mul = act_and_mul
        # (every expert's formats: what a test or a log line asks of a layer)
        self.type_names = sorted({part.type_name for parts in experts.gate_up for part in parts} |
                                 {weight.type_name for weight in experts.down})

    def __call__(self, x: torch.Tensor, router_logits: torch.Tensor, top_k: int,
                 renormalize: bool) -> torch.Tensor:
        return fused_moe(x, router_logits, self, top_k, renormalize, self.act_and_mul)
