"""A checkpoint's routed experts into the stacked parameters of ``moe.RoutedExperts``.

transformers' ``save_pretrained`` writes one tensor per expert and projection
(``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``; Mixtral's ``w1``, ``w3``,
``w2``, which ``moe_families.checkpoint_name`` renames to these); it holds them in memory
stacked (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) and
writes that with ``save_original_format=False``. Both load.
Tensor-parallel: a rank takes its rows of each expert's gate and up, its columns of each down.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from actorlm.kernels import QuantizedWeight
from actorlm.models.families import narrow
from actorlm.models.parallel import TensorParallel

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def is_experts_param(param_name: str) -> bool:
    return _STACKED.match(param_name) is not None


def expert_keys(param_name: str, num_experts: int) -> list[str]:
    """What must be loaded to fill a stacked parameter: its rows' per-expert checkpoint names."""
    prefix, projection = _STACKED.match(param_name).groups()
    parts = ("gate_proj", "up_proj") if projection == "gate_up_proj" else ("down_proj",)
    return [f"{prefix}.{e}.{part}.weight" for e in range(num_experts) for part in parts]


def expert_parts(name: str, tensor, params: dict[str, torch.Tensor],
                 tp: TensorParallel) -> list[tuple[list[str], torch.Tensor, Any]] | None:
    """Where the checkpoint tensor ``name`` goes, if it is routed experts' (else None): a list
    of (the keys it fills, the destination rows, this rank's part of the tensor). A slice of a
    safetensors file in place of the tensor reads only that part."""
    per_expert, stacked = _PER_EXPERT.match(name), _STACKED.match(name)
    if per_expert is None and stacked is None:
        return None
    if isinstance(tensor, QuantizedWeight):
        raise ValueError(f"{name!r}: routed experts in {tensor.type_name} blocks are not "
                         f"implemented")
    if per_expert is not None:
        prefix, expert, projection = per_expert.group(1), int(per_expert.group(2)), \
            per_expert.group(3)
        stacked_name = f"{prefix}.{'down_proj' if projection == 'down_proj' else 'gate_up_proj'}"
        if stacked_name not in params or expert >= params[stacked_name].shape[0]:
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        if projection == "down_proj":
            dst = params[stacked_name][expert]  # [H, I_rank]
            size = dst.shape[1]
            return [([name], dst, narrow(tensor, 1, tp.rank * size, size))]
        gate_up = params[stacked_name][expert]  # [2 I_rank, H]
        size = gate_up.shape[0] // 2
        dst = gate_up.narrow(0, 0 if projection == "gate_proj" else size, size)
        return [([name], dst, narrow(tensor, 0, tp.rank * size, size))]
    prefix, projection = stacked.groups()
    if name not in params:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    dst = params[name]
    num_experts = dst.shape[0]
    if projection == "down_proj":  # [E, H, I]
        size = dst.shape[2]
        keys = expert_keys(name, num_experts)
        return [(keys, dst, narrow(tensor, 2, tp.rank * size, size))]
    size = dst.shape[1] // 2  # [E, 2I, H]: this rank's gate rows, then its up rows
    whole = size * tp.size
    return [([f"{prefix}.{e}.{part}.weight" for e in range(num_experts)],
             dst.narrow(1, index * size, size),
             narrow(tensor, 1, index * whole + tp.rank * size, size))
            for index, part in enumerate(("gate_proj", "up_proj"))]
