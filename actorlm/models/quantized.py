"""Weights in GGUF block formats at load time: quantizing a checkpoint's weights
(``--quantization q8_0 | q4_0``) and slicing block rows for tensor parallelism (dequantizing
is ``kernels.portable.dequantize``). The ``gguf`` package does the block arithmetic (and is
the kernels' test oracle); nothing here runs per step.
"""

from __future__ import annotations

import torch

from actorlm.kernels import QuantizedWeight
from actorlm.kernels.resident import resident

QUANTIZATIONS = ("gguf", "q8_0", "q4_0")  # --quantization; gguf: a .gguf model's own blocks
# quantized at load to Q8_0 whatever --quantization says: the embedding and the LM head, where
# llama.cpp too keeps 8 bits (a 4-bit vocabulary projection costs the most accuracy)
_VOCABULARY_TYPE = "Q8_0"


def block_elements(type_name: str) -> int:
    """Values per block of the format (32, or 256 for the K formats)."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]


def quantize(weight: torch.Tensor, quantization: str, vocabulary: bool) -> QuantizedWeight | None:
    """``weight`` [out, in] in ``quantization``'s blocks (Q8_0 for a ``vocabulary`` matrix), or
    None where its rows do not divide into whole blocks."""
    import gguf

    type_name = _VOCABULARY_TYPE if vocabulary else quantization.upper()
    if weight.dim() != 2 or weight.shape[1] % block_elements(type_name):
        return None
    kind = gguf.GGMLQuantizationType[type_name]
    blocks = gguf.quants.quantize(weight.detach().float().numpy(), kind)
    return QuantizedWeight(type_name, resident(torch.from_numpy(blocks)), tuple(weight.shape))


def narrow(weight: QuantizedWeight, dim: int, start: int, length: int) -> QuantizedWeight:
    """Rows (dim 0) or input columns (dim 1) ``start:start + length`` of ``weight``; columns
    only on block boundaries (``check_split`` refuses the others before loading)."""
    rows, columns = weight.shape
    if dim == 0:
        return QuantizedWeight(weight.type_name, weight.blocks.narrow(0, start, length),
                               (length, columns))
    per_block = block_elements(weight.type_name)
    if start % per_block or length % per_block:
        raise ValueError(split_error(weight.type_name, columns, length))
    block_bytes = weight.blocks.shape[1] * per_block // columns
    first, end = start // per_block * block_bytes, (start + length) // per_block * block_bytes
    return QuantizedWeight(weight.type_name, weight.blocks[:, first:end], (rows, length))


def pad_rows(weight: QuantizedWeight, rows: int) -> QuantizedWeight:
    """``weight`` with zero rows appended up to ``rows`` (a zero block is zero in every format:
    its scales are)."""
    missing = rows - weight.shape[0]
    if missing <= 0:
        return weight
    blocks = torch.cat([weight.blocks, weight.blocks.new_zeros(missing, weight.blocks.shape[1])])
    return QuantizedWeight(weight.type_name, blocks, (rows, weight.shape[1]))


def split_error(type_name: str, in_features: int, share: int) -> str:
    return (f"the {in_features} input features of a {type_name} weight split into shares of "
            f"{share}, not a multiple of {type_name}'s {block_elements(type_name)}-value "
            f"blocks: choose a --tensor-parallel-size whose share is")


def check_split(type_name: str, in_features: int, size: int) -> None:
    """Refuse, before loading, a row-parallel split of a ``type_name`` weight that would cut
    its blocks."""
    if size > 1 and (in_features // size) % block_elements(type_name):
        raise ValueError(f"--tensor-parallel-size {size}: "
                         f"{split_error(type_name, in_features, in_features // size)}")
