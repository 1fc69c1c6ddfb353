"""FP8 checkpoints of a tiny model for the tests: compressed-tensors' ``float-quantized``
(llm-compressor's FP8, FP8_DYNAMIC and FP8_BLOCK schemes) written by the ``compressed-tensors``
package itself, which transformers then runs as the oracle, activations quantized as the
checkpoint says; and the same block-quantized values as the ``fp8`` method's checkpoint
(``weight_scale_inv``, ``weight_block_size``: Qwen3's and DeepSeek's FP8 releases)."""

from __future__ import annotations

import json
import pathlib

import torch
from prequantized_files import _copy_dir

FP8_MAX = 448.0  # float8_e4m3fn's largest value
BLOCK = 32  # the tiny models' weight blocks and activation groups (the releases' are 128)


def write_fp8(src: pathlib.Path, out: pathlib.Path, weights: str = "channel",
              activations: str | None = "token") -> pathlib.Path:
    """``src``'s projections in FP8 (``weights``: tensor, channel or block scales; the
    activations quantized per ``token`` or per ``group`` of ``BLOCK`` features by their
    largest magnitude, per ``tensor`` by a static scale calibrated on a few prompts, or not
    at all), as the ``compressed-tensors`` package compresses and saves them."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme, apply_quantization_config)
    from transformers import AutoModelForCausalLM

    weight_args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=weights,
                                   block_structure=[BLOCK, BLOCK] if weights == "block" else None)
    input_args = None if activations is None else QuantizationArgs(
        num_bits=8, type="float", symmetric=True, strategy=activations,
        dynamic=activations != "tensor", group_size=BLOCK if activations == "group" else None)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    static_scales = _calibrated_input_scales(model) if activations == "tensor" else {}
    scheme = QuantizationScheme(targets=["Linear"], weights=weight_args,
                                input_activations=input_args)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme},
                                                        ignore=["lm_head"]))
    for name, module in model.named_modules():
        if hasattr(module, "weight_scale"):
            scale = _weight_scales(module.weight.data, weights)
            module.weight_scale.data = scale.view_as(module.weight_scale).bfloat16()
        if name in static_scales:
            module.input_scale.data = static_scales[name].view_as(module.input_scale)
    compressor = ModelCompressor.from_pretrained_model(model, "float-quantized")
    compressor.compress_model(model)
    _copy_dir(src, out)
    model.save_pretrained(out)
    compressor.update_config(out)
    return out


def _weight_scales(w: torch.Tensor, strategy: str) -> torch.Tensor:
    """Each tensor's, row's or BLOCK x BLOCK block's largest magnitude over FP8_MAX."""
    if strategy == "tensor":
        return w.abs().amax().reshape(1) / FP8_MAX
    if strategy == "channel":
        return w.abs().amax(1, keepdim=True) / FP8_MAX
    rows, cols = w.shape
    blocks = w.reshape(rows // BLOCK, BLOCK, cols // BLOCK, BLOCK)
    return blocks.abs().amax((1, 3)) / FP8_MAX


def _calibrated_input_scales(model) -> dict[str, torch.Tensor]:
    """Each projection's input's largest magnitude over FP8_MAX, on a few prompts."""
    largest: dict[str, torch.Tensor] = {}

    def observe(name):
        def hook(module, args):
            seen = args[0].detach().abs().amax()
            largest[name] = torch.maximum(largest.get(name, seen), seen)
        return hook

    hooks = [module.register_forward_pre_hook(observe(name))
             for name, module in model.named_modules()
             if isinstance(module, torch.nn.Linear) and name != "lm_head"]
    with torch.no_grad():
        model(torch.arange(3, 40).reshape(1, -1) % model.config.vocab_size)
    for hook in hooks:
        hook.remove()
    return {name: (value / FP8_MAX).float().reshape(1) for name, value in largest.items()}


def as_fp8_method(block_checkpoint: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """A compressed-tensors FP8_BLOCK checkpoint (``write_fp8(weights="block",
    activations="group")``) rewritten as the ``fp8`` method saves the same values: each
    ``weight_scale`` renamed ``weight_scale_inv`` (in fp32), the config's
    ``weight_block_size`` and dynamic activations."""
    from safetensors.torch import load_file, save_file

    _copy_dir(block_checkpoint, out)
    tensors = load_file(block_checkpoint / "model.safetensors")
    renamed = {name.replace(".weight_scale", ".weight_scale_inv"):
               tensor.float() if name.endswith(".weight_scale") else tensor
               for name, tensor in tensors.items()}
    save_file(renamed, out / "model.safetensors")
    config = json.loads((block_checkpoint / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK],
                                     "modules_to_not_convert": ["lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def write_fp8_method(src: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """Every projection of ``src`` (routed experts' too; not the routers, the embedding or the
    head) in FP8 blocks of BLOCK x BLOCK, saved as the fp8 method saves them."""
    from safetensors.torch import load_file, save_file

    _copy_dir(src, out)
    tensors = {}
    for name, tensor in load_file(src / "model.safetensors").items():
        if name.endswith("_proj.weight") and tensor.dim() == 2:
            scale = _weight_scales(tensor.float(), "block")
            expanded = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
            tensor = (tensor.float() / expanded).to(torch.float8_e4m3fn)
            tensors[name.replace(".weight", ".weight_scale_inv")] = scale
        tensors[name] = tensor
    save_file(tensors, out / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    (out / "config.json").write_text(json.dumps(config))
    return out
