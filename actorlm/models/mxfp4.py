"""GPT-OSS's experts in MXFP4 (``quantization_config: {"quant_method": "mxfp4"}``, OpenAI's
releases), read into Q5_0 blocks with no loss.

MXFP4 stores each expert projection [E, out, in] as ``*_blocks`` [E, out, in / 32, 16] (two
FP4 e2m1 values a byte, the lower nibble first) and ``*_scales`` [E, out, in / 32] (E8M0: a
power of two, 2^(s - 127), per 32 values). An FP4 value is one of 0, 0.5, 1, 1.5, 2, 3, 4, 6
with a sign; twice it, an integer k in -12..12. So a block is k * 2^(s - 128): Q5_0's
``d * (q - 16)`` with q = k + 16 (five bits) and d = 2^(s - 128), which fp16 holds exactly for
the scales weights have (s from 104 to 143; ``prequantized.as_weight`` dequantizes a weight
with any other at load instead). Q5_0 takes 22 bytes for 32 values where MXFP4 takes 17 and
bf16 64: gpt-oss-20b's experts in about 13 GB, on the quantized kernels both wings have.

Each projection becomes one weight per expert (``experts.{e}.gate_proj`` …, the names the
other families' experts load by), its gate and up rows taken apart: GPT-OSS interleaves them
(row 2i is gate feature i, row 2i + 1 up feature i). The biases, router and attention are
plain tensors of the checkpoint.

A GGUF file's MXFP4 tensors (llama.cpp's ``gpt-oss`` files: the experts) hold the same values
in ggml's block, 17 bytes: the E8M0 scale, then 16 bytes whose low nibbles are values 0-15 and
high nibbles 16-31 (``gguf_grouped``); they become Q5_0 blocks the same way.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Iterable, Iterator

import torch

from actorlm.kernels import QuantizedWeight

log = logging.getLogger(__name__)

_PARTS = ("_blocks", "_scales")
# twice each FP4 value, by its nibble (bit 3 the sign)
_DOUBLED = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12],
                        dtype=torch.int8)


def check(config: dict) -> None:
    """Nothing in an mxfp4 ``quantization_config`` changes the math but its method: the
    modules it leaves out (``modules_to_not_convert``) are the checkpoint's plain tensors."""


def read_tensors(tensors: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype
                 ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The checkpoint's pairs with each MXFP4 projection as its experts' weights, in blocks
    or in ``dtype`` (``prequantized.as_weight``); other tensors pass as they are."""
    from actorlm.models.prequantized import Grouped, as_weight  # (prequantized imports this)

    held: dict[str, dict[str, torch.Tensor]] = {}
    kinds = Counter()
    for name, tensor in tensors:
        stem, part = next(((name.removesuffix(p), p) for p in _PARTS if name.endswith(p)),
                          (name, None))
        if part is None:
            yield name, tensor
            continue
        parts = held.setdefault(stem, {})
        parts[part] = tensor
        if len(parts) < len(_PARTS):
            continue
        del held[stem]
        for expert_name, grouped in _experts(stem, parts["_blocks"], parts["_scales"], Grouped):
            weight, kind = as_weight(grouped, dtype, copied=False)
            kinds[kind] += 1
            yield expert_name, weight
    if held:
        raise ValueError(f"the checkpoint lacks the blocks or scales of {sorted(held)}")
    log.info("mxfp4 checkpoint: %s", ", ".join(f"{n} x {k}" for k, n in sorted(kinds.items())))


def gguf_grouped(raw: torch.Tensor, rows: int):
    """A GGUF MXFP4 tensor's bytes as ``prequantized.Grouped`` [rows, 32 x blocks]."""
    from actorlm.models.prequantized import Grouped

    blocks = raw.view(rows, -1, 17)
    qs = blocks[..., 1:]
    nibbles = torch.cat((qs & 0x0F, qs >> 4), -1).flatten(1)  # [rows, in]
    return Grouped(_doubled(nibbles), None, _steps(blocks[..., 0]), 5)


def _doubled(nibbles: torch.Tensor) -> torch.Tensor:
    """FP4 nibbles as Q5_0's values, q = 2 x value + 16."""
    return (_DOUBLED[nibbles.long()] + 16).to(torch.uint8)


def _steps(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 scales s as the step of a doubled value, 2^(s - 128)."""
    return torch.exp2(scales.float() - 128)


def _experts(stem: str, blocks: torch.Tensor, scales: torch.Tensor, grouped):
    """(per-expert name, ``Grouped``) of the stacked projection ``stem``
    (``...mlp.experts.gate_up_proj`` or ``down_proj``)."""
    prefix, _, projection = stem.rpartition(".")
    if not prefix.endswith(".mlp.experts") or projection not in ("gate_up_proj", "down_proj"):
        raise ValueError(f"{stem}: MXFP4 is implemented for GPT-OSS's experts only")
    if blocks.dim() != 4 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"{stem}: MXFP4 blocks {tuple(blocks.shape)} do not fit scales "
                         f"{tuple(scales.shape)}")
    nibbles = torch.stack((blocks & 0x0F, blocks >> 4), -1).flatten(-3)  # [E, out, in]
    values, steps = _doubled(nibbles), _steps(scales)
    rows = {"down_proj": (slice(None),)} if projection == "down_proj" else \
        {"gate_proj": (slice(0, None, 2),), "up_proj": (slice(1, None, 2),)}
    for expert in range(values.shape[0]):
        for name, (taken,) in rows.items():
            yield f"{prefix}.{expert}.{name}.weight", grouped(
                values[expert, taken].contiguous(), None, steps[expert, taken].contiguous(), 5)
