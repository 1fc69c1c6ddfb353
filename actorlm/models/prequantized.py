"""Checkpoints quantized before they were saved: GPTQ, AWQ and compressed-tensors'
``pack-quantized`` (llm-compressor's W4A16 and W8A16), as a Hugging Face directory's
``quantization_config`` names them.

Each of these stores a linear weight as integers of ``bits`` bits with a scale (and, when
asymmetric, a zero point) per group of consecutive input features: ``w = s * (q - z)``. The
formats differ only in how they pack the integers into int32 words (``_unpack``) and lay out
the groups, so each reader turns its tensors into one ``Grouped`` and one function turns that
into what the kernels read:

- 4 bits, symmetric (z at the midpoint 8): Q4_0 blocks, ``d * (q - 8)`` with d = s, exactly
  where the scale is an fp16 (GPTQ's are; a bf16 scale converts exactly).
- 4 bits with zero points (AWQ, asymmetric GPTQ or compressed-tensors): Q4_1 blocks,
  ``d * q + m`` with d = s and m = -s * z rounded to fp16, as the peers' fp16 dequantization
  rounds ``s * (q - z)``.
- 8 bits where every ``q - z`` fits an int8: Q8_0 blocks, ``d * (q - z)``, exactly.
- Anything else (2 bits, groups of other than a multiple of 32 features, act-order groups that
  are not consecutive, a scale beyond fp16's range): the weight dequantized at load into the
  model's dtype (logged once, with why), so it is served, as a dense weight.

FP8 weights (the ``fp8`` method, compressed-tensors' ``float-quantized``) are ``fp8``'s to
read, GPT-OSS's MXFP4 experts ``mxfp4``'s (into Q5_0 blocks, exactly: 5-bit values,
symmetric). A field of ``quantization_config`` that changes the math and is not computed here
(integer weights with quantized activations, a KV-cache scheme, transforms, sparsity, other
methods such as bitsandbytes) is refused by name before anything loads.
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch

from actorlm.kernels import QuantizedWeight
from actorlm.kernels.resident import resident
from actorlm.models import fp8, mxfp4
from actorlm.models.quantized import is_expert_weight

log = logging.getLogger(__name__)

# quant_method -> the --quantization names that mean it (vLLM's, its Marlin kernels' too)
METHODS = {"gptq": ("gptq", "gptq_marlin"), "awq": ("awq", "awq_marlin"),
           "compressed-tensors": ("compressed-tensors",), "fp8": ("fp8",), "mxfp4": ("mxfp4",)}
_BLOCK = 32  # values per block of Q4_0, Q4_1 and Q8_0
_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # word bits 4i..4i+3 hold column _AWQ_ORDER[i] of eight


@dataclass
class Grouped:
    """One linear weight as the formats store it: ``values`` [out, in] and ``zeros`` [out,
    groups] unsigned integers of ``bits`` bits (zeros None: the midpoint, symmetric), ``scales``
    [out, groups]; input feature i is in group ``group_of[i]`` (None: consecutive groups of
    in / groups features)."""

    values: torch.Tensor
    zeros: torch.Tensor | None
    scales: torch.Tensor
    bits: int
    group_of: torch.Tensor | None = None

    def mismatch(self) -> str:
        """What in the shapes does not fit together ("" where they do): a damaged or
        misdescribed checkpoint."""
        (out, in_features), groups = self.values.shape, self.scales.shape[-1]
        if self.scales.shape != (out, groups) or groups == 0:
            return f"scales {tuple(self.scales.shape)} for a weight {out} x {in_features}"
        if self.zeros is not None and self.zeros.shape != self.scales.shape:
            return f"zero points {tuple(self.zeros.shape)} beside scales " \
                   f"{tuple(self.scales.shape)}"
        if self.group_of is None:
            return "" if in_features % groups == 0 else \
                f"{in_features} input features in {groups} equal groups"
        if self.group_of.shape != (in_features,) or not (
                0 <= int(self.group_of.min()) and int(self.group_of.max()) < groups):
            return f"group indices that do not name {in_features} features' groups of {groups}"
        return ""

    def _runs(self) -> torch.Tensor:
        """Each input feature's group if the groups were consecutive runs of in / groups."""
        in_features, groups = self.values.shape[1], self.scales.shape[1]
        return torch.arange(in_features) // (in_features // groups)

    def consecutive_group_size(self) -> int | None:
        """Features per group where the groups are consecutive runs, else None."""
        in_features, groups = self.values.shape[1], self.scales.shape[1]
        if in_features % groups or (self.group_of is not None and
                                    not torch.equal(self.group_of.long(), self._runs())):
            return None
        return in_features // groups

    def dense(self) -> torch.Tensor:
        """``s * (q - z)`` in fp32."""
        groups = self._runs() if self.group_of is None else self.group_of.long()
        zeros = self.zeros[:, groups].float() if self.zeros is not None else 2.0**(self.bits - 1)
        return (self.values.float() - zeros) * self.scales[:, groups].float()


def quantization_config(path: pathlib.Path) -> dict | None:
    """The directory's ``quantization_config`` (config.json's), or None."""
    try:
        value = json.loads((pathlib.Path(path) / "config.json").read_text()) \
            .get("quantization_config")
    except (OSError, ValueError):
        return None
    return value if value else None


def held_in_blocks(path: pathlib.Path) -> bool:
    """Whether the directory's checkpoint loads into blocks (its integer weights do; FP8
    weights are dequantized)."""
    config = quantization_config(path)
    return config is not None and not fp8.is_fp8(config)


def check(config: dict, quantization: str | None) -> None:
    """Refuse, by name, a ``quantization_config`` this engine does not compute, or a
    ``--quantization`` that contradicts it."""
    if not isinstance(config, dict):
        raise ValueError(f"quantization_config must be an object, got {config!r}")
    method = config.get("quant_method")
    if method not in METHODS:
        raise ValueError(f"quantization_config.quant_method {method!r} is not implemented "
                         f"(served: {', '.join(METHODS)}; GGUF files in their own blocks)")
    if quantization is not None and quantization not in METHODS[method]:
        raise ValueError(f"--quantization {quantization} does not apply to a checkpoint "
                         f"quantized with {method} (leave it out, or say "
                         f"{' or '.join(METHODS[method])})")
    {"gptq": _check_gptq, "awq": _check_awq, "compressed-tensors": _check_ct,
     "fp8": fp8.check_fp8_method, "mxfp4": mxfp4.check}[method](config)


def _bits_dividing_a_word(bits, where: str) -> None:
    if bits not in (2, 4, 8):
        raise ValueError(f"{where} {bits!r} is not implemented (2, 4 or 8 bits)")


def _check_gptq(config: dict) -> None:
    _bits_dividing_a_word(config.get("bits"), "gptq: bits")
    if config.get("checkpoint_format", "gptq") not in ("gptq", "gptq_v2"):
        raise ValueError(f"gptq: checkpoint_format {config['checkpoint_format']!r} is not "
                         f"implemented (gptq, gptq_v2)")
    if config.get("dynamic"):
        raise ValueError("gptq: dynamic (per-module bits and groups) is not implemented")


def _check_awq(config: dict) -> None:
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        raise ValueError(f"awq: bits {bits!r} is not implemented (4 bits)")
    if str(config.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"awq: version {config['version']!r} is not implemented (gemm)")
    if not config.get("zero_point", True):
        raise ValueError("awq: zero_point false is not implemented")


def _check_ct(config: dict) -> None:
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if config.get(field):
            raise ValueError(f"compressed-tensors: {field} is not implemented")
    groups = config.get("config_groups") or {}
    if not groups or not all(isinstance(group, dict) for group in groups.values()):
        raise ValueError(f"compressed-tensors: config_groups {groups!r} is no set of objects")
    floats = [(group.get("weights") or {}).get("type") == "float" for group in groups.values()]
    if any(floats) and not all(floats):
        raise ValueError("compressed-tensors: config groups of both FP8 and integer weights "
                         "are not implemented")
    for name, group in groups.items():
        where = f"compressed-tensors: config_groups.{name}"
        form = group.get("format") or config.get("format")
        if any(floats):
            if form not in ("float-quantized", "naive-quantized"):
                raise ValueError(f"{where}: format {form!r} of FP8 weights is not "
                                 f"implemented (float-quantized)")
            fp8.check_ct_group(where, group)
            continue
        if form != "pack-quantized":
            raise ValueError(f"{where}: format {form!r} is not implemented (pack-quantized: "
                             f"integer weights, activations in the model's dtype)")
        for field in ("input_activations", "output_activations"):
            if group.get(field):
                raise ValueError(f"{where}.{field} is not implemented (weights only)")
        weights = group.get("weights") or {}
        if weights.get("type", "int") != "int" or weights.get("dynamic"):
            raise ValueError(f"{where}.weights: only static integer weights are implemented")
        _bits_dividing_a_word(weights.get("num_bits"), f"{where}.weights.num_bits")
        if weights.get("strategy") not in ("group", "channel", "tensor"):
            raise ValueError(f"{where}.weights.strategy {weights.get('strategy')!r} is not "
                             f"implemented (group, channel, tensor)")


def _unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 ``words`` [R, C], each holding 32 / bits values (value j in bits j * bits and up,
    lowest first) along ``dim``, as unsigned values: [R * 32/bits, C] or [R, C * 32/bits]."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    if dim == 0:
        values = words.unsqueeze(1) >> shifts.view(1, per_word, 1)
    else:
        values = words.unsqueeze(2) >> shifts.view(1, 1, per_word)
    values = (values & ((1 << bits) - 1)).to(torch.uint8)
    shape = list(words.shape)
    shape[dim] *= per_word
    return values.reshape(shape)


def _gptq(parts: dict, config: dict, module: str) -> Grouped:
    """qweight [in * bits/32, out] packed along the inputs, qzeros [groups, out * bits/32]
    along the outputs, scales [groups, out], g_idx [in]; a ``gptq`` (v1) checkpoint stores
    each zero point less one."""
    bits = config["bits"]
    values = _unpack(parts["qweight"], bits, 0).T
    zeros = _unpack(parts["qzeros"], bits, 1).T.contiguous()
    if config.get("checkpoint_format", "gptq") == "gptq":
        zeros = ((zeros.int() + 1) & ((1 << bits) - 1)).to(torch.uint8)
    out = values.shape[0]
    return Grouped(values, zeros[:out], parts["scales"].T, bits, parts.get("g_idx"))


def _awq(parts: dict, config: dict, module: str) -> Grouped:
    """qweight [in, out / 8] and qzeros [groups, out / 8], eight columns a word in AWQ's
    order; scales [groups, out]."""
    def columns(words):
        values = _unpack(words, 4, 1)
        order = torch.tensor(_AWQ_ORDER)
        natural = torch.empty_like(order)
        natural[order] = torch.arange(8)  # the word position of each column
        index = (torch.arange(values.shape[1]) // 8 * 8) + natural.repeat(values.shape[1] // 8)
        return values[:, index].T.contiguous()

    return Grouped(columns(parts["qweight"]), columns(parts["qzeros"]), parts["scales"].T, 4)


def _ct(parts: dict, config: dict, module: str) -> Grouped:
    """weight_packed [out, in * bits/32] along the inputs, values offset by the midpoint;
    weight_scale [out, groups] (one group: channel or tensor); weight_zero_point packed along
    the outputs [out * bits/32, groups] when asymmetric; weight_shape [out, in]."""
    weights = _ct_group(config, module)["weights"]
    bits = weights["num_bits"]
    out, in_features = (int(n) for n in parts["weight_shape"])
    values = _unpack(parts["weight_packed"], bits, 1)[:, :in_features]
    scales = parts["weight_scale"].reshape(out, -1) if parts["weight_scale"].numel() > 1 \
        else parts["weight_scale"].reshape(1, 1).expand(out, 1)
    zeros = None
    if not weights.get("symmetric", True):
        if "weight_zero_point" not in parts:
            raise ValueError(f"{module}: an asymmetric weight without weight_zero_point")
        zeros = _unpack(parts["weight_zero_point"], bits, 0)[:out]
    return Grouped(values, zeros, scales, bits, parts.get("weight_g_idx"))


def _ct_group(config: dict, module: str) -> dict:
    """The config group whose targets name ``module`` (a class name, the module's name, or
    ``re:`` and a pattern)."""
    groups = list(config["config_groups"].values())
    for group in groups:
        for target in group.get("targets", ()):
            if target in ("Linear", module) or (
                    target.startswith("re:") and re.match(target[3:], module)):
                return group
    if len(groups) == 1:
        return groups[0]
    raise ValueError(f"compressed-tensors: no config group targets {module}")


# quant_method -> (its tensors of a quantized module, the ones it may lack, the reader)
_FORMATS = {
    "gptq": (("qweight", "qzeros", "scales", "g_idx"), ("g_idx",), _gptq),
    "awq": (("qweight", "qzeros", "scales"), (), _awq),
    "compressed-tensors": (("weight_packed", "weight_scale", "weight_shape",
                            "weight_zero_point", "weight_g_idx"),
                           ("weight_zero_point", "weight_g_idx"), _ct),
}


def read_tensors(tensors: Iterable[tuple[str, torch.Tensor]], config: dict,
                 dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's (name, tensor) pairs with each quantized module's tensors put together
    into its ``.weight``: in blocks, or dequantized into ``dtype`` (see the module's doc). The
    other tensors pass as they are. A module's tensors may come in any order and any file, so
    the quantized ones are held until the checkpoint has been read. FP8 weights are ``fp8``'s
    to read."""
    if fp8.is_fp8(config):
        yield from fp8.read_tensors(tensors, config, dtype, lambda m: _ct_group(config, m))
        return
    if config["quant_method"] == "mxfp4":
        yield from mxfp4.read_tensors(tensors, dtype)
        return
    method = config["quant_method"]
    names, optional, reader = _FORMATS[method]
    held: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        module, _, part = name.rpartition(".")
        if part in names:
            held.setdefault(module, {})[part] = tensor
        else:
            yield name, tensor
    kinds = Counter()
    for module, parts in held.items():
        missing = [p for p in names if p not in parts and p not in optional]
        if missing:
            raise ValueError(f"{module}: the checkpoint lacks {', '.join(missing)}")
        grouped = reader(parts, config, module)
        if mismatch := grouped.mismatch():
            raise ValueError(f"{module}: {mismatch}")
        weight, kind = as_weight(grouped, dtype,
                                 copied=not is_expert_weight(f"{module}.weight"))
        kinds[kind] += 1
        yield f"{module}.weight", weight
    log.info("%s checkpoint: %s", method,
             ", ".join(f"{n} x {kind}" for kind, n in sorted(kinds.items())))


def as_weight(g: Grouped, dtype: torch.dtype,
              copied: bool = True) -> tuple[torch.Tensor | QuantizedWeight, str]:
    """``g`` in the blocks that hold it (module doc), or dense in ``dtype``; and which, or
    why dense. Blocks ``copied`` into huge pages, or left for their layer to copy (an
    expert's)."""
    size = g.consecutive_group_size()
    why = _why_no_blocks(g, size)
    if why:
        return g.dense().to(dtype), f"dense ({why})"
    out, in_features = g.values.shape
    per_block = size // _BLOCK
    d = g.scales.float().repeat_interleave(per_block, dim=1)  # [out, blocks]
    values = g.values.reshape(out, -1, _BLOCK)
    zeros = None if g.zeros is None else \
        g.zeros.repeat_interleave(per_block, dim=1).unsqueeze(-1).int()
    fields = [_halves(d)]  # each block's scale, then (Q4_1) its offset, then its values
    if g.bits == 8:
        type_name = "Q8_0"
        quants = (values.int() - (128 if zeros is None else zeros)).to(torch.int8)
        quants = quants.view(torch.uint8)
    elif g.bits == 5:  # (MXFP4's: symmetric) each value's fifth bit in qh, bit j of value j
        type_name = "Q5_0"
        high = (values >> 4).long() << torch.arange(_BLOCK)
        qh = high.sum(-1, keepdim=True).view(torch.uint8)[..., :4]  # little-endian uint32
        low = values & 0x0F
        quants = torch.cat((qh, low[..., :16] | (low[..., 16:] << 4)), -1)
    else:
        symmetric = zeros is None or bool((zeros == 8).all())
        type_name = "Q4_0" if symmetric else "Q4_1"
        if not symmetric:
            fields.append(_halves(-d * zeros[..., 0]))
        quants = values[..., :16] | (values[..., 16:] << 4)
    blocks = torch.cat([*fields, quants], dim=-1).reshape(out, -1)
    return QuantizedWeight(type_name, resident(blocks) if copied else blocks,
                           (out, in_features)), type_name


def _halves(values: torch.Tensor) -> torch.Tensor:
    """[out, blocks] as fp16 bytes [out, blocks, 2] (little-endian, as the blocks store
    them)."""
    return values.to(torch.float16).contiguous().view(torch.uint8).view(*values.shape, 2)


def _why_no_blocks(g: Grouped, group_size: int | None) -> str:
    """Why no block format holds ``g`` ("" where one does)."""
    if g.bits not in (4, 5, 8) or g.bits == 5 and g.zeros is not None:
        return f"{g.bits}-bit values" + (" with zero points" if g.bits == 5 else "")
    if group_size is None:
        return "groups of features that are not consecutive runs"
    if group_size % _BLOCK:
        return f"groups of {group_size} features"
    if not float(g.scales.float().abs().max()) * 2**g.bits < torch.finfo(torch.float16).max:
        return "scales beyond fp16's range"
    if g.bits == 5 and not torch.equal(g.scales.half().float(), g.scales.float()):
        return "scales fp16 does not hold exactly"
    if g.bits == 8 and g.zeros is not None:
        q = g.values.int() - g.zeros.int().repeat_interleave(group_size, dim=1)
        if int(q.min()) < -128 or int(q.max()) > 127:
            return "zero points that put q - z outside int8's range"
    return ""
