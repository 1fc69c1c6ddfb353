"""Routed experts in torch ops, on any device (``KernelBackend.fused_moe``): the CPU wing's path
where its experts are not packed, and the routing (``route``) that every path shares.

A step's tokens are grouped by expert, not looped over: the (token, expert) pairs are sorted by
expert, each expert with tokens runs its gate/up and down projections once over all of its rows,
and the rows go back to their tokens. So a step costs one pair of matmuls per expert it touches,
whatever its number of tokens (a decode step of one token: ``top_k`` pairs; a long prefill: at
most one pair per expert).

Under expert parallelism the experts are one rank's share (``Experts.first_expert`` on): the
slots routed to the others are left out of the groups and add zero, so the rank's result is
its part of the sum, which the model's all-reduce completes.

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


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: Experts,
                    act_and_mul: Callable = portable.act_and_mul) -> torch.Tensor:
    """sum over j of weights[t, j] * expert ids[t, j] (x[t]) for each token: x [T, H], weights
    and ids [T, k] (the router's expert ids) -> [T, H], a slot on an expert that ``experts``
    does not hold adding nothing. ``act_and_mul`` is the wing's (gate_up [n, 2I] -> [n, I])."""
    check_activation(experts.activation)
    num_tokens, top_k = ids.shape
    num_experts = experts.gate_up.shape[0]
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
    start = 0
    for expert, count in enumerate(counts[:num_experts]):
        if count == 0:
            continue
        end = start + count
        hidden = act_and_mul(F.linear(rows[start:end], experts.gate_up[expert]),
                             experts.activation)  # [n, I]
        # the product in fp32 (the weights' dtype), rounded to x's dtype by the copy
        out[start:end] = F.linear(hidden, experts.down[expert]) * slot_weights[start:end]
        start = end
    slots = x.new_zeros(num_tokens * top_k, x.shape[1])
    slots[held] = out  # back in token order: [T k, H]
    slots = slots.view(num_tokens, top_k, -1)
    total = slots[:, 0]
    for j in range(1, top_k):  # in ascending expert order, each sum rounded to the dtype
        total = total + slots[:, j]
    return total.contiguous()


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, experts: Experts, top_k: int,
              renormalize: bool, act_and_mul: Callable = portable.act_and_mul) -> torch.Tensor:
    """``KernelBackend.fused_moe`` in torch ops: x [T, H], router_logits [T, E] -> [T, H]."""
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    weights, ids = route(router_logits, top_k, renormalize)
    return grouped_experts(x, weights, ids, experts, act_and_mul)
