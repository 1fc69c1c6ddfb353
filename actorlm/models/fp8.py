"""FP8 checkpoints: weights stored as float8_e4m3fn values with scales, and (mostly) the
activations quantized to FP8 too before each matmul, as the checkpoint was calibrated for.

Two layouts say so in a Hugging Face directory's ``quantization_config``:

- ``quant_method: fp8`` (vLLM's and transformers' own: Qwen3's and DeepSeek's FP8 releases):
  ``weight`` with ``weight_scale_inv`` per block of ``weight_block_size`` [rows, inputs], the
  activations quantized per token and group of that many inputs; or, without blocks, a
  ``weight_scale`` per tensor, the activations per token (``activation_scheme: dynamic``) or by
  the checkpoint's ``input_scale`` (``static``).
- compressed-tensors with ``format: float-quantized`` (llm-compressor's FP8, FP8_DYNAMIC,
  FP8_BLOCK): ``weight`` with a ``weight_scale`` per tensor, row or block; ``input_activations``
  per token or group (dynamic), per tensor by ``input_scale`` (static), or none (weights only).

The weights are dequantized at load into the model's dtype (``w = s * q``): no kernel here
multiplies FP8. The activations are rounded to FP8 and back before each matmul
(``kernels.ActivationQuant``, through the backend's ``quantize_inputs``): that rounding is
part of the checkpoint's math, so it is computed, not dropped (vLLM's CPU and pre-Ada GPU
paths drop it and run the weights only). Under tensor parallelism a row-parallel layer's
per-token scale is the largest magnitude over every rank's share of the row (one more
all-reduce), so the split changes nothing; per-group scales need each rank's share to hold
whole groups.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from actorlm.kernels import ActivationQuant

log = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
_SCALES = ("weight_scale", "weight_scale_inv")  # the fp8 method names its block scales _inv
_STRATEGIES = {"weights": ("tensor", "channel", "block"),
               "input_activations": ("token", "group", "tensor")}


def joined(a: ActivationQuant, b: ActivationQuant) -> ActivationQuant:
    """One rounding for a merged layer (q/k/v, gate/up) whose parts had these for their shared
    input: the larger static scale, as vLLM takes for its fused layers."""
    if (a.scale is None) != (b.scale is None) or a.group != b.group:
        raise ValueError(f"parts of one merged layer round their shared input differently: "
                         f"{a} and {b}")
    return a if a.scale is None else ActivationQuant(scale=max(a.scale, b.scale))


def is_fp8(config: dict) -> bool:
    """Whether a ``quantization_config`` describes FP8 weights (either layout)."""
    if config.get("quant_method") == "fp8":
        return True
    groups = config.get("config_groups") or {}
    return config.get("quant_method") == "compressed-tensors" and any(
        isinstance(g, dict) and (g.get("weights") or {}).get("type") == "float"
        for g in groups.values())


def check_fp8_method(config: dict) -> None:
    """Refuse, by name, an ``fp8`` method config this engine does not compute."""
    if config.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"fp8: fmt {config['fmt']!r} is not implemented (e4m3)")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"fp8: activation_scheme {scheme!r} is not implemented "
                         f"(dynamic, static)")
    block = config.get("weight_block_size")
    if block is not None:
        _check_block(block, "fp8: weight_block_size")
        if scheme == "static":
            raise ValueError("fp8: static activation scales with weight_block_size are not "
                             "implemented (block checkpoints quantize activations dynamically)")


def check_ct_group(where: str, group: dict) -> None:
    """Refuse, by name, a compressed-tensors config group of FP8 weights that is not
    computed here."""
    if group.get("output_activations"):
        raise ValueError(f"{where}.output_activations is not implemented")
    for field, strategies in _STRATEGIES.items():
        args = group.get(field)
        if not args and field == "input_activations":
            continue
        if not isinstance(args, dict):
            raise ValueError(f"{where}.{field} must be an object, got {args!r}")
        if args.get("type") != "float" or args.get("num_bits") != 8:
            raise ValueError(f"{where}.{field}: {args.get('num_bits')}-bit "
                             f"{args.get('type')} values are not implemented (8-bit float)")
        if not args.get("symmetric", True):
            raise ValueError(f"{where}.{field}: asymmetric FP8 is not implemented")
        strategy = args.get("strategy")
        if strategy not in strategies:
            raise ValueError(f"{where}.{field}.strategy {strategy!r} is not implemented "
                             f"({', '.join(strategies)})")
        dynamic = bool(args.get("dynamic"))
        if dynamic != (field == "input_activations" and strategy != "tensor"):
            raise ValueError(f"{where}.{field}: dynamic {dynamic} with strategy {strategy!r} "
                             f"is not implemented (weights static; activations per token or "
                             f"group dynamic, per tensor static)")
        if strategy == "block":
            _check_block(args.get("block_structure"), f"{where}.{field}.block_structure")
        if strategy == "group" and not (isinstance(args.get("group_size"), int) and
                                        args["group_size"] > 0):
            raise ValueError(f"{where}.{field}.group_size {args.get('group_size')!r} is not "
                             f"a positive integer")


def _check_block(block, where: str) -> None:
    if not (isinstance(block, list) and len(block) == 2 and
            all(isinstance(n, int) and n > 0 for n in block)):
        raise ValueError(f"{where} {block!r} is not two positive integers")


@dataclass(frozen=True)
class _Scheme:
    """One module's FP8 layout: its weight's ``block`` of scales [rows, inputs] (None: one
    scale per tensor or row) and how its ``inputs`` are quantized: per "token", per "group" of
    ``group`` features, per "tensor" by a static scale, or not at all (None)."""

    block: tuple[int, int] | None
    inputs: str | None
    group: int | None = None

    def quant(self, parts: dict) -> ActivationQuant | None:
        if self.inputs == "tensor":
            return ActivationQuant(scale=float(parts["input_scale"]))
        return None if self.inputs is None else ActivationQuant(group=self.group)


def _scheme(config: dict, group: dict | None) -> _Scheme:
    """The layout that ``config`` (the fp8 method's) or its compressed-tensors config
    ``group`` gives a module."""
    if group is None:
        block = config.get("weight_block_size")
        if config.get("activation_scheme", "dynamic") == "static":
            return _Scheme(None, "tensor")
        return _Scheme(tuple(block), "group", block[1]) if block else _Scheme(None, "token")
    weights, inputs = group["weights"], group.get("input_activations") or {}
    block = weights.get("block_structure") if weights.get("strategy") == "block" else None
    return _Scheme(tuple(block) if block else None, inputs.get("strategy"),
                   inputs.get("group_size"))


def read_tensors(tensors: Iterable[tuple[str, torch.Tensor]], config: dict, dtype: torch.dtype,
                 group_of: Callable[[str], dict]
                 ) -> Iterator[tuple[str, torch.Tensor | ActivationQuant]]:
    """The checkpoint's (name, tensor) pairs with each FP8 weight dequantized into ``dtype``
    under its own name, followed, where the module's inputs are quantized, by
    (``module.input_quant``, its ``ActivationQuant``); the other tensors as they are.
    ``group_of(module)``: the compressed-tensors config group that applies to the module. A
    module's weight and scales are held until all have been read."""
    method = config.get("quant_method")
    held: dict[str, dict[str, torch.Tensor]] = {}
    count, rounded = 0, Counter()
    for name, tensor in tensors:
        module, _, part = name.rpartition(".")
        if not (part in (*_SCALES, "input_scale") or part == "weight" and tensor.dtype == FP8):
            yield name, tensor
            continue
        parts = held.setdefault(module, {})
        parts[part] = tensor
        if "weight" not in parts or not any(s in parts for s in _SCALES):
            continue
        scheme = _scheme(config, None if method == "fp8" else group_of(module))
        if scheme.inputs == "tensor" and "input_scale" not in parts:
            continue
        parts = held.pop(module)
        scale = parts.get("weight_scale_inv", parts.get("weight_scale")).float()
        weight = _dequantized(module, parts["weight"], scale, scheme.block)
        yield f"{module}.weight", weight.to(dtype)
        quant = scheme.quant(parts)
        if quant is not None and not module.endswith("embed_tokens"):  # a lookup: no input
            yield f"{module}.input_quant", quant
            rounded[f"per {scheme.inputs}" if scheme.inputs != "tensor" else "static"] += 1
        count += 1
    if held:
        module, parts = next(iter(held.items()))
        what = "an FP8 weight without its scale" if "weight" in parts else \
            f"{', '.join(sorted(parts))} without its FP8 weight"
        raise ValueError(f"{module}: the checkpoint holds {what}")
    log.info("FP8 checkpoint: %d weights dequantized into %s; inputs rounded to FP8: %s", count,
             str(dtype).removeprefix("torch."),
             ", ".join(f"{n} {kind}" for kind, n in sorted(rounded.items())) or "none")


def _dequantized(module: str, weight: torch.Tensor, scale: torch.Tensor,
                 block: tuple[int, int] | None) -> torch.Tensor:
    """``s * q`` in fp32: s per ``block`` of the weight (a grid of ceil(out / rows) x
    ceil(in / inputs) scales), else one per tensor ([] or [1]) or per row ([out] or
    [out, 1])."""
    if weight.dim() != 2:
        raise ValueError(f"{module}: an FP8 weight of {weight.dim()} dimensions (experts "
                         f"stacked in one tensor) is not implemented")
    out, in_features = weight.shape
    if block is not None:
        rows, cols = block
        if scale.shape != (-(-out // rows), -(-in_features // cols)):
            raise ValueError(f"{module}: scales {tuple(scale.shape)} do not tile a weight "
                             f"{out} x {in_features} in blocks of {rows} x {cols}")
        scale = scale.repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :in_features]
    elif scale.numel() == 1:
        scale = scale.reshape(1, 1)
    elif scale.shape in ((out,), (out, 1)):
        scale = scale.reshape(out, 1)
    else:
        raise ValueError(f"{module}: scales {tuple(scale.shape)} for a weight "
                         f"{out} x {in_features}")
    return weight.float() * scale
