"""Tiny checkpoints quantized before they were saved, in the layouts of GPTQ, AWQ and
compressed-tensors, each beside its oracle: the same checkpoint with every quantized weight
dequantized (fp32) and no ``quantization_config``, for transformers to run.

GPTQ's and AWQ's tensors are packed here from their formats' descriptions (GPTQ: eight 4-bit
values a word along the input features, lowest bits first, zero points stored less one in a
``gptq`` (v1) checkpoint; AWQ: eight output columns a word in the order 0, 2, 4, 6, 1, 3, 5, 7),
as AutoGPTQ's and AutoAWQ's packers write them. compressed-tensors' are written by the
``compressed-tensors`` package itself, and dequantized by it for the oracle.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
             "w1", "w2", "w3")  # (Mixtral's experts: gate, down, up)


def _quantize(weight: torch.Tensor, bits: int, group: int, symmetric: bool):
    """Min/max quantization of ``weight`` [out, in] by groups of ``group`` inputs: q [out, in]
    and zeros [out, G] unsigned, scales [out, G] fp16 (rounded first, so the dequantized
    weight is what a kernel reading fp16 scales computes)."""
    out, in_features = weight.shape
    w = weight.float().view(out, in_features // group, group)
    top = 2**bits - 1
    if symmetric:
        scales = (w.abs().amax(-1) / (2**(bits - 1) - 1)).clamp(min=1e-6).half().float()
        zeros = torch.full_like(scales, 2**(bits - 1))
    else:
        low, high = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
        scales = ((high - low) / top).clamp(min=1e-6).half().float()
        zeros = (-low / scales).round().clamp(0, top)
    q = (w / scales.unsqueeze(-1) + zeros.unsqueeze(-1)).round().clamp(0, top)
    return q.view(out, in_features).int(), zeros.int(), scales.half()


def _dense(q, zeros, scales, group_of) -> torch.Tensor:
    return (q - zeros[:, group_of]).float() * scales[:, group_of].float()


def _pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``values`` packed 32 / bits a word along ``dim``, lowest bits first."""
    per = 32 // bits
    v = values.int().movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per) << (torch.arange(per, dtype=torch.int32) * bits)
    return _to_int32(v.sum(-1, dtype=torch.int64)).movedim(-1, dim).contiguous()


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, cols] 4-bit values, eight columns a word in AWQ's order."""
    v = values.int().reshape(values.shape[0], -1, 8)[..., list(AWQ_ORDER)]
    return _to_int32((v << (torch.arange(8, dtype=torch.int32) * 4)).sum(-1, dtype=torch.int64))


def _copy_dir(src: pathlib.Path, dst: pathlib.Path) -> None:
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()


def write(src: pathlib.Path, out: pathlib.Path, method: str, bits: int = 4, group: int = 32,
          symmetric: bool = True, shuffled_groups: bool = False) -> tuple[pathlib.Path,
                                                                          pathlib.Path]:
    """``src``'s projections quantized with ``method`` (gptq, gptq_v2, awq) into ``out /
    'quantized'``, and the oracle ``out / 'dense'``; ``shuffled_groups``: GPTQ's act-order,
    each input's group from a g_idx that is not consecutive runs."""
    from safetensors.torch import load_file

    state = load_file(src / "model.safetensors")
    quantized, dense = {}, {}
    for i, (name, weight) in enumerate(sorted(state.items())):
        module = name.removesuffix(".weight")
        if module.rsplit(".", 1)[-1] not in QUANTIZED:
            quantized[name] = dense[name] = weight
            continue
        q, zeros, scales = _quantize(weight, bits, group, symmetric)
        in_features = weight.shape[1]
        group_of = torch.arange(in_features) // group
        if shuffled_groups:
            group_of = group_of[torch.randperm(in_features, generator=torch.Generator()
                                               .manual_seed(i))]
            q, zeros, scales = _regrouped(weight, bits, group_of, symmetric)
        dense[name] = _dense(q, zeros, scales, group_of)
        if method == "awq":
            quantized[f"{module}.qweight"] = _awq_pack(q.T)
            quantized[f"{module}.qzeros"] = _awq_pack(zeros.T)
        else:
            stored = zeros - 1 if method == "gptq" else zeros  # v1 stores them less one
            quantized[f"{module}.qweight"] = _pack(q.T, bits, 0)
            quantized[f"{module}.qzeros"] = _pack(stored.T & (2**bits - 1), bits, 1)
            quantized[f"{module}.g_idx"] = group_of.int()
        quantized[f"{module}.scales"] = scales.T.contiguous()
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
              "version": "gemm"} if method == "awq" else \
        {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": symmetric,
         "desc_act": shuffled_groups, "checkpoint_format": method}
    return _save(src, out, quantized, dense, config)


def _regrouped(weight, bits, group_of, symmetric):
    """``_quantize`` by the groups ``group_of`` names (act-order): each group's inputs
    gathered, quantized together, and put back."""
    order = torch.argsort(group_of, stable=True)
    group = int((group_of == 0).sum())
    q, zeros, scales = _quantize(weight[:, order], bits, group, symmetric)
    back = torch.empty_like(q)
    back[:, order] = q
    return back, zeros, scales


def _save(src, out, quantized, dense, config):
    from safetensors.torch import save_file

    paths = out / "quantized", out / "dense"
    for path, tensors in zip(paths, (quantized, dense)):
        _copy_dir(src, path)
        save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
    meta = json.loads((paths[0] / "config.json").read_text())
    meta["quantization_config"] = config
    (paths[0] / "config.json").write_text(json.dumps(meta))
    return paths


def write_compressed_tensors(src: pathlib.Path, out: pathlib.Path, bits: int = 4,
                             strategy: str = "group", group: int = 32,
                             symmetric: bool = True) -> tuple[pathlib.Path, pathlib.Path]:
    """``src``'s projections quantized by the ``compressed-tensors`` package (pack-quantized,
    as llm-compressor saves W4A16 / W8A16), and the oracle from the package's own
    decompression."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme, apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                            group_size=group if strategy == "group" else None)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    apply_quantization_config(model, QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
        ignore=["lm_head"]))
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            w = w.view(w.shape[0], -1, group) if strategy == "group" else w.unsqueeze(1)
            scale, zero = calculate_qparams(w.amin(-1), w.amax(-1), args)
            # scales as llm-compressor saves them, in the model's 16-bit dtype
            module.weight_scale.data = scale.view_as(module.weight_scale).bfloat16()
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.data.copy_(zero.view_as(module.weight_zero_point))
    compressor = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    compressor.compress_model(model)
    quantized_dir, dense_dir = out / "quantized", out / "dense"
    _copy_dir(src, quantized_dir)
    model.save_pretrained(quantized_dir)
    compressor.update_config(quantized_dir)
    compressor.decompress_model(model)
    _copy_dir(src, dense_dir)
    dense = {k: v.float() for k, v in model.state_dict().items()
             if not k.rsplit(".", 1)[-1].startswith(("weight_scale", "weight_zero"))}
    from safetensors.torch import save_file

    if model.config.tie_word_embeddings:
        dense.pop("lm_head.weight", None)
    save_file(dense, dense_dir / "model.safetensors")
    return quantized_dir, dense_dir
