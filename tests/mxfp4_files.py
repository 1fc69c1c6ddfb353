"""Tiny GPT-OSS checkpoints with their experts in MXFP4, as OpenAI's releases store them
(``quantization_config: {"quant_method": "mxfp4"}``): each expert projection's weight
[E, out, in] as ``*_blocks`` [E, out, in / 32, 16] (two FP4 e2m1 values a byte, the lower
nibble first) and ``*_scales`` [E, out, in / 32] (a power of two per 32 values, E8M0: its
exponent + 127); everything else as it was. transformers reads it back, dequantized, for the
oracle (``Mxfp4Config(dequantize=True)``).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import torch
from safetensors.torch import load_file, save_file

# the 16 FP4 (e2m1) values by their nibble: sign in bit 3
FP4_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                           -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., in] -> (blocks [..., in / 32, 16] uint8, scales [..., in / 32] uint8): each
    32 values' scale the power of two that brings their largest magnitude to at most 6, each
    value the nearest FP4 value of it over the scale."""
    w = weight.float().unflatten(-1, (-1, 32))
    largest = w.abs().amax(-1, keepdim=True).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(largest / 6.0))
    nibbles = (w / torch.exp2(exponent)).unsqueeze(-1).sub(FP4_VALUES).abs().argmin(-1)
    pairs = nibbles.to(torch.uint8).unflatten(-1, (16, 2))
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks, (exponent[..., 0] + 127).to(torch.uint8)


def write_mxfp4(dense_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """``dense_dir``'s GPT-OSS checkpoint with its experts' weights in MXFP4 (their biases,
    router and attention as they were) -> ``out``."""
    shutil.copytree(dense_dir, out)
    [weights] = out.glob("*.safetensors")
    state = load_file(weights)
    for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        # (the dense checkpoint stores them [E, in, out]; MXFP4 [E, out, in] in blocks)
        blocks, scales = quantize(state.pop(name).transpose(1, 2))
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
    save_file(state, weights, metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out
