"""A checkpoint's routed experts into the stacked parameters of ``moe.RoutedExperts``.

transformers' ``save_pretrained`` writes one tensor per expert and projection
(``mlp.experts.{e}.gate_proj.weight``, ``up_proj``, ``down_proj``; Mixtral's ``w1``, ``w3``,
``w2``, which ``moe_families.checkpoint_name`` renames to these); it holds them in memory
stacked (``mlp.experts.gate_up_proj`` [E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) and
writes that with ``save_original_format=False``. Both load. A GGUF file's stacked experts
arrive split into the per-expert names (``gguf_file``). A per-expert tensor in GGUF blocks
(``QuantizedWeight``) is not copied: it goes to ``RoutedExperts.load_quantized`` and stays in
its blocks.
Tensor-parallel: a rank takes its rows of each expert's gate and up, its columns of each down.
Expert-parallel: a rank takes its experts whole and reads nothing of the others'.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import torch

from actorlm.kernels import QuantizedWeight
from actorlm.models.checkpoint_names import narrow
from actorlm.models.parallel import TensorParallel

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# GPT-OSS's: gate/up's [E, 2I] (or a GGUF file's gate's and up's apart, [E, I] each), down's
_BIASES = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_bias|gate_bias|up_bias|down_bias)$")
_HALVES = {"gate_bias": 0, "up_bias": 1}


class ExpertPart(NamedTuple):
    """Where (part of) a checkpoint tensor goes: the keys it fills, the destination rows of
    the stacked parameter, this rank's ``part`` of the tensor; for one expert's tensor also
    its ``slot``, (the experts' module, ``gate_up_proj`` or ``down_proj``, this rank's index
    of the expert, the first row), where a part in blocks is kept."""

    keys: list[str]
    dst: torch.Tensor
    part: Any
    slot: tuple[str, str, int, int] | None = None


def is_experts_param(param_name: str) -> bool:
    return _STACKED.match(param_name) is not None


def bias_keys(param_name: str) -> list[str] | None:
    """What must be loaded to fill a stacked bias parameter (gate/up's: both halves), or None
    if it is none."""
    match = _BIASES.match(param_name)
    if match is None:
        return None
    return [f"{param_name}#0", f"{param_name}#1"] if match[2] == "gate_up_bias" else [param_name]


def held_experts(stacked: torch.Tensor, tp: TensorParallel) -> range:
    """The router's ids of the experts a stacked parameter [E_rank, ...] holds."""
    first, count = tp.local_experts(_num_experts(stacked, tp))
    return range(first, first + count)


def _num_experts(stacked: torch.Tensor, tp: TensorParallel) -> int:
    """The router's number of experts, from this rank's stacked parameter."""
    return stacked.shape[0] * (tp.size if tp.expert_parallel else 1)


def expert_keys(param_name: str, experts: range) -> list[str]:
    """What must be loaded to fill a stacked parameter holding ``experts``: their per-expert
    checkpoint names."""
    prefix, projection = _STACKED.match(param_name).groups()
    parts = ("gate_proj", "up_proj") if projection == "gate_up_proj" else ("down_proj",)
    return [f"{prefix}.{e}.{part}.weight" for e in experts for part in parts]


def expert_parts(name: str, tensor, params: dict[str, torch.Tensor],
                 tp: TensorParallel) -> list[ExpertPart] | None:
    """Where the checkpoint tensor ``name`` goes, if it is routed experts' (else None): a list
    of ``ExpertPart``, empty for an expert another rank holds. A slice of a safetensors file in
    place of the tensor reads only that part."""
    per_expert, stacked = _PER_EXPERT.match(name), _STACKED.match(name)
    if _BIASES.match(name):
        return _bias_parts(name, tensor, params, tp)
    if per_expert is None and stacked is None:
        return None
    if per_expert is None and isinstance(tensor, QuantizedWeight):  # (the loaders split them)
        raise ValueError(f"{name!r}: stacked experts in {tensor.type_name} blocks are loaded "
                         f"one expert at a time (experts.{{e}}.*_proj.weight)")
    if per_expert is not None:
        return _per_expert_part(name, per_expert.groups(), tensor, params, tp)
    prefix, projection = stacked.groups()
    if name not in params:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    dst = params[name]
    experts = held_experts(dst, tp)
    if tp.expert_parallel:  # this rank's experts, whole: [E_rank, 2I, H] or [E_rank, H, I]
        return [ExpertPart(expert_keys(name, experts), dst,
                           narrow(tensor, 0, experts.start, len(experts)))]
    if projection == "down_proj":  # [E, H, I]
        size = dst.shape[2]
        return [ExpertPart(expert_keys(name, experts), dst,
                           narrow(tensor, 2, tp.rank * size, size))]
    size = dst.shape[1] // 2  # [E, 2I, H]: this rank's gate rows, then its up rows
    whole = size * tp.size
    return [ExpertPart([f"{prefix}.{e}.{part}.weight" for e in experts],
                       dst.narrow(1, index * size, size),
                       narrow(tensor, 1, index * whole + tp.rank * size, size))
            for index, part in enumerate(("gate_proj", "up_proj"))]


def _bias_parts(name, tensor, params, tp) -> list[ExpertPart]:
    """``expert_parts`` for the stacked experts' biases: gate/up's [E, 2I] ([gate | up]; a GGUF
    file's gate and up halves apart) or down's [E, H]: a rank's experts' whole, or its share of
    the gate and up features; down's every rank holds whole (one adds it: ``RoutedExperts``)."""
    prefix, kind = _BIASES.match(name).groups()
    target = f"{prefix}.gate_up_bias" if kind in _HALVES else name
    if target not in params:
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    dst = params[target]
    experts = held_experts(dst, tp)
    if kind == "down_bias":
        return [ExpertPart([name], dst, narrow(tensor, 0, experts.start, len(experts)))]
    size = dst.shape[1] // 2  # this rank's features of each half
    halves = [_HALVES[kind]] if kind in _HALVES else [0, 1]
    if tp.expert_parallel:
        tensor = narrow(tensor, 0, experts.start, len(experts))
    whole = size * (1 if tp.expert_parallel else tp.size)  # a half's features in the tensor
    share = 0 if tp.expert_parallel else tp.rank * size  # this rank's first of them
    return [ExpertPart([f"{target}#{index}"], dst.narrow(1, index * size, size),
                       narrow(tensor, 1, (index * whole if len(halves) == 2 else 0) + share,
                              size))
            for index in halves]


def _per_expert_part(name, groups, tensor, params, tp):
    """``expert_parts`` for one expert's projection, ``experts.{e}.{projection}.weight``."""
    prefix, expert, projection = groups[0], int(groups[1]), groups[2]
    stacked_name = f"{prefix}.{'down_proj' if projection == 'down_proj' else 'gate_up_proj'}"
    if stacked_name not in params or expert >= _num_experts(params[stacked_name], tp):
        raise ValueError(f"unexpected weight {name!r} in checkpoint")
    experts = held_experts(params[stacked_name], tp)
    if expert not in experts:
        return []  # another rank's
    local = expert - experts.start
    held = params[stacked_name][local]  # [H, I_rank] or [2 I_rank, H]
    size = held.shape[1] if projection == "down_proj" else held.shape[0] // 2
    first = 0 if tp.expert_parallel else tp.rank * size  # its features: all, or this rank's
    module, stacked_projection = stacked_name.rsplit(".", 1)
    if projection == "down_proj":
        return [ExpertPart([name], held, narrow(tensor, 1, first, size),
                           (module, stacked_projection, local, 0))]
    first_row = 0 if projection == "gate_proj" else size
    return [ExpertPart([name], held.narrow(0, first_row, size), narrow(tensor, 0, first, size),
                       (module, stacked_projection, local, first_row))]
