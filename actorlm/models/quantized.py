"""Weights in GGUF block formats at load time: quantizing a checkpoint's weights, routed
experts included (``--quantization q8_0 | q4_0``), and slicing block rows for tensor
parallelism (dequantizing is ``kernels.portable.dequantize``). The ``gguf`` package does the
block arithmetic (and is the kernels' test oracle); nothing here runs per step.
"""

from __future__ import annotations

import re

import torch

from actorlm.kernels import QuantizedWeight
from actorlm.kernels.resident import resident

QUANTIZATIONS = ("gguf", "q8_0", "q4_0")  # --quantization; gguf: a .gguf model's own blocks
# quantized at load to Q8_0 whatever --quantization says: the embedding and the LM head, where
# llama.cpp too keeps 8 bits (a 4-bit vocabulary projection costs the most accuracy)
_VOCABULARY_TYPE = "Q8_0"
_EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.\w+\.weight$")  # one expert's (Mixtral's w1 too)
_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")


def block_elements(type_name: str) -> int:
    """Values per block of the format (32, or 256 for the K formats)."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[type_name]][0]


def is_expert_weight(name: str) -> bool:
    """Whether ``name`` is one routed expert's weight, which its layer copies out itself."""
    return _EXPERT_WEIGHT.search(name) is not None


def quantize(weight: torch.Tensor, quantization: str, vocabulary: bool,
             copied: bool = True) -> QuantizedWeight | None:
    """``weight`` [out, in] in ``quantization``'s blocks (Q8_0 for a ``vocabulary`` matrix), or
    None where its rows do not divide into whole blocks; the blocks ``copied`` into huge pages
    (``kernels.resident``), or left where the quantizer wrote them (an expert's, which its
    layer copies)."""
    import gguf

    type_name = _VOCABULARY_TYPE if vocabulary else quantization.upper()
    if weight.dim() != 2 or weight.shape[1] % block_elements(type_name):
        return None
    kind = gguf.GGMLQuantizationType[type_name]
    blocks = torch.from_numpy(gguf.quants.quantize(weight.detach().float().numpy(), kind))
    return QuantizedWeight(type_name, resident(blocks) if copied else blocks,
                           tuple(weight.shape))


def quantize_checkpoint(tensors, quantization: str):
    """``--quantization``: the linear layers' weights of a checkpoint's (name, tensor) pairs in
    ``quantization``'s blocks where their rows divide into blocks (the others as they are);
    the routed experts one expert at a time (a stacked checkpoint's split into the per-expert
    names ``expert_weights`` loads), left uncopied for their layer to copy. The routers
    (``mlp.gate``, ``shared_expert_gate``: a few rows, read once a token) stay in floats, where
    the routing keeps transformers' choices of experts."""
    for name, tensor in tensors:
        stacked = _STACKED_EXPERTS.match(name)
        if stacked is not None:
            yield from _quantized_experts(stacked, tensor, quantization)
            continue
        expert = is_expert_weight(name)
        vocabulary = name in ("model.embed_tokens.weight", "lm_head.weight")
        if vocabulary or expert or name.endswith("_proj.weight"):
            tensor = quantize(tensor, quantization, vocabulary, copied=not expert) or tensor
        yield name, tensor


def _quantized_experts(stacked, tensor: torch.Tensor, quantization: str):
    """A checkpoint's stacked gate/up [E, 2I, H] or down [E, H, I] (the layout the experts are
    held in: ``moe_families.experts_as_held``) one expert and projection at a time, in blocks
    where its rows divide into them."""
    prefix, projection = stacked.groups()
    size = tensor.shape[1] // 2
    for expert, values in enumerate(tensor):
        parts = [("down_proj", values)] if projection == "down_proj" else \
            [("gate_proj", values[:size]), ("up_proj", values[size:])]
        for part, rows in parts:  # (rows that do not divide into blocks: as they are)
            yield f"{prefix}.{expert}.{part}.weight", \
                quantize(rows, quantization, False, copied=False) or rows


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
