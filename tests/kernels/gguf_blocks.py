"""Weights in GGML blocks for the quantized kernels' tests, and the float64 oracle of what those
kernels compute: gguf.quants' own dequantize, and x quantized to int8 per block."""

from __future__ import annotations

import gguf
import numpy as np
import torch

from actorlm.kernels.backend import QuantizedWeight

QTYPE = gguf.GGMLQuantizationType
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")  # gguf.quants.quantize takes these
# byte offsets of the f16 fields: the scales d, and the mins (added: Q4_1's m; subtracted:
# the K formats' dmin)
_D = {"Q4_0": 0, "Q4_1": 0, "Q5_0": 0, "Q8_0": 0, "Q4_K": 0, "Q5_K": 0, "Q6_K": 208}
_ADDED_MIN = {"Q4_1": 2}
_SUBTRACTED_MIN = {"Q4_K": 2, "Q5_K": 2}


def block_values(type_name: str) -> int:
    return gguf.GGML_QUANT_SIZES[QTYPE[type_name]][0]


def random_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row bytes] of valid blocks: a normal weight quantized by gguf where it can (rows
    of differing scales), else random bytes with f16 scales of either sign in [1e-3, 1e-2]."""
    qtype = QTYPE[type_name]
    if type_name in QUANTIZABLE:
        weight = rng.standard_normal((rows, k)) * rng.uniform(0.1, 2.0, (rows, 1))
        return gguf.quants.quantize(weight.astype(np.float32), qtype)
    values, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * k // values, size), dtype=np.uint8)
    for offset in (_D[type_name], _SUBTRACTED_MIN.get(type_name)):
        if offset is not None:
            scale = rng.uniform(1e-3, 1e-2, blocks.shape[0]) * rng.choice([-1, 1], blocks.shape[0])
            blocks[:, offset:offset + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def quantized_weight(type_name: str, blocks: np.ndarray, k: int) -> QuantizedWeight:
    return QuantizedWeight(type_name, torch.from_numpy(blocks.copy()), (blocks.shape[0], k))


def dequantized(type_name: str, blocks: np.ndarray) -> torch.Tensor:
    """gguf.quants' dequantize, float64 [rows, k]."""
    return torch.from_numpy(gguf.quants.dequantize(blocks, QTYPE[type_name]).astype(np.float64))


def magnitudes(type_name: str, blocks: np.ndarray) -> torch.Tensor:
    """Per weight, the sum of the magnitudes of the parts a kernel computes apart: |d q| + |m|
    (Q4_1), |d sc q| + |dmin m| (Q4_K, Q5_K), else |w|: gguf's dequantize of the blocks with
    every f16 scale made positive and a subtracted min negative, so the parts add."""
    fixed = blocks.copy()
    for offset in (_D[type_name], _ADDED_MIN.get(type_name)):
        if offset is not None:
            fixed[:, offset + 1::gguf.GGML_QUANT_SIZES[QTYPE[type_name]][1]] &= 0x7F
    if type_name in _SUBTRACTED_MIN:
        fixed[:, _SUBTRACTED_MIN[type_name] + 1::gguf.GGML_QUANT_SIZES[QTYPE[type_name]][1]] |= 0x80
    return dequantized(type_name, fixed).abs()


def quantize_x(x: torch.Tensor, values: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [M, K] as the kernels quantize it, in float64: per block of ``values``,
    d = max |x| / 127 and x_q = d round(x / d). Returns (x_q, d per element, near_tie): where
    x / d is within 1e-4 of a half-integer, fp32 may round it the other way (one step of d)."""
    blocks = x.double().reshape(x.shape[0], -1, values)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    scaled = blocks / torch.where(d > 0, d, 1.0)
    x_q = torch.round(scaled) * d
    near_tie = (scaled - scaled.floor() - 0.5).abs() < 1e-4
    d_each = d.expand_as(blocks)
    return (x_q.reshape(x.shape), d_each.reshape(x.shape), near_tie.reshape(x.shape))
