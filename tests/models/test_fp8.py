"""FP8 checkpoints (compressed-tensors' float-quantized, the fp8 method's blocks) against
transformers running the same checkpoint, which rounds each projection's input to FP8 as the
checkpoint says (``fp8_files``); the rounding itself against FP8's definition; and what is
refused, by name."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from fp8_files import as_fp8_method, write_fp8
from quantized_oracle import check_greedy_and_kl

from actorlm.kernels import ActivationQuant, portable, select_backend
from actorlm.models import prequantized
from actorlm.models.fp8 import joined
from actorlm.models.loader import _safetensors, check_quantization, load_model

SCHEMES = {  # name -> (weight scales, activations): llm-compressor's FP8 schemes
    "fp8-dynamic": ("channel", "token"),
    "fp8-static": ("tensor", "tensor"),
    "fp8-block": ("block", "group"),
    "fp8-weights-only": ("channel", None),
}
MAX_KL = 1e-3  # nats; measured 0 to 2e-4 here


def _transformers(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _their_weights(path) -> dict[str, torch.Tensor]:
    """Each FP8 projection's weight as the ``compressed-tensors`` package dequantizes it."""
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    return {f"{name}.weight": dequantize(m.weight, m.weight_scale, dtype=torch.float32,
                                         args=m.quantization_scheme.weights)
            for name, m in _transformers(path).named_modules() if hasattr(m, "weight_scale")}


def _our_weights(path) -> dict[str, torch.Tensor]:
    tensors = prequantized.read_tensors(_safetensors(path, sliced=False),
                                        prequantized.quantization_config(path), torch.float32)
    return {name: tensor for name, tensor in tensors if name.endswith("_proj.weight")}


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_an_fp8_checkpoint_computes_what_transformers_computes(
        scheme, family, tiny_llama_dir, tiny_qwen2_dir, tmp_path):
    """fp32: the weights exactly the ``compressed-tensors`` package's dequantization; the
    next-token distributions over a prompt and its greedy continuation within MAX_KL of
    transformers', which rounds every projection's input to FP8 as the checkpoint says (the
    same weights with inputs left as they are land 0.06-0.1 nats away on these models: a
    single rounding that float noise tips the other way moves the logits visibly, so they
    are not compared one by one), and greedy tokens alike."""
    src = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir}[family]
    path = write_fp8(src, tmp_path / scheme, *SCHEMES[scheme])
    theirs = _their_weights(path)
    ours = _our_weights(path)
    assert ours.keys() == theirs.keys() and len(ours) == 14
    assert all(torch.equal(ours[name], weight) for name, weight in theirs.items())
    model = load_model(path, torch.float32, "cpu", select_backend("cpu"))
    assert check_greedy_and_kl(model, _transformers(path)) < MAX_KL


def test_the_fp8_method_reads_its_blocks_as_compressed_tensors_does(tiny_qwen2_dir, tmp_path):
    """The same FP8 values and block scales saved as the fp8 method saves them
    (``weight_scale_inv``, ``weight_block_size``, dynamic activations per token and group of
    a block's inputs): the same weights, and what transformers computes on the
    compressed-tensors checkpoint."""
    block = write_fp8(tiny_qwen2_dir, tmp_path / "ct", "block", "group")
    path = as_fp8_method(block, tmp_path / "fp8")
    ours, theirs = _our_weights(path), _their_weights(block)
    assert all(torch.equal(ours[name], weight) for name, weight in theirs.items())
    model = load_model(path, torch.float32, "cpu", select_backend("cpu"))
    assert check_greedy_and_kl(model, _transformers(block)) < MAX_KL


def test_bf16_is_as_close_to_fp32_as_transformers_in_bf16(tiny_llama_dir, tmp_path):
    """In bf16 the inputs' FP8 roundings tip one way or the other with every rounding before
    them: transformers itself lands 0.06-0.1 nats from its fp32 run on these models. Ours,
    greedy over the prompt, no further (a quarter more at most)."""
    from quantized_oracle import logits_and_greedy, mean_kl, their_logits
    from transformers import AutoModelForCausalLM

    path = write_fp8(tiny_llama_dir, tmp_path / "fp8", "channel", "token")
    ours = load_model(path, torch.bfloat16, "cpu", select_backend("cpu"))
    prompt = list(range(3, 23))
    logits, tokens, _ = logits_and_greedy(ours, prompt, 24)
    ids = prompt + tokens[:-1]
    fp32 = their_logits(_transformers(path), ids)
    bf16 = their_logits(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16), ids)
    assert mean_kl(fp32, logits) <= 1.25 * mean_kl(fp32, bf16)


def _check_fp8_values(q):
    """Each row of q (values over their scale, to fp32 rounding) holds e4m3 values, and its
    largest magnitude is 448."""
    exact = dict(rtol=2**-20, atol=0)
    torch.testing.assert_close(q, q.to(torch.float8_e4m3fn).float(), **exact)
    torch.testing.assert_close(q.abs().amax(-1), torch.full((q.shape[0],), 448.0), **exact)


def test_rounding_gives_fp8_values_times_the_scale():
    """Per row: the largest magnitude lands on 448 exactly, every value is an e4m3 value
    times the row's scale, a row of zeros stays zeros; per group, each group has its own
    scale; a static scale saturates what lies beyond 448 of it."""
    torch.manual_seed(0)
    x = torch.randn(3, 64) * torch.tensor([[1.0], [1e-3], [0.0]])
    rounded = portable.round_to_fp8(x, ActivationQuant())
    scale = x.abs().amax(-1, keepdim=True)[:2] / 448
    _check_fp8_values(rounded[:2] / scale)
    assert torch.equal(rounded[2], torch.zeros(64))
    assert ((rounded[:2] - x[:2]).abs() <= x[:2].abs() / 16 + scale * 2**-9).all()

    grouped = x[:1].clone()
    grouped[0, 32:] *= 1000
    by_group = portable.round_to_fp8(grouped, ActivationQuant(group=32))
    scales = grouped.view(2, 32).abs().amax(-1, keepdim=True) / 448
    _check_fp8_values(by_group.view(2, 32) / scales)
    by_row = portable.round_to_fp8(grouped, ActivationQuant())
    assert (by_row[0, :32] != by_group[0, :32]).any()  # the big half's scale swamps them

    static = portable.round_to_fp8(torch.tensor([[1.0, -1000.0, 0.3]]),
                                   ActivationQuant(scale=1 / 448))
    # 0.3 * 448 = 134.4: between the e4m3 values 128 and 144
    assert torch.equal(static, torch.tensor([[448.0, -448.0, 128.0]]) / 448)


def test_merged_parts_share_the_larger_static_scale_and_no_mixture():
    assert joined(ActivationQuant(scale=0.5), ActivationQuant(scale=2.0)) == \
        ActivationQuant(scale=2.0)
    assert joined(ActivationQuant(group=32), ActivationQuant(group=32)) == \
        ActivationQuant(group=32)
    with pytest.raises(ValueError, match="round their shared input differently"):
        joined(ActivationQuant(), ActivationQuant(scale=1.0))


def _with_config(src, dst, change):
    shutil.copytree(src, dst)
    meta = json.loads((dst / "config.json").read_text())
    change(meta["quantization_config"])
    (dst / "config.json").write_text(json.dumps(meta))
    return dst


def _group(config):
    return config["config_groups"]["group_0"]


@pytest.mark.parametrize("change, message", [
    (lambda c: _group(c)["weights"].update(num_bits=4),
     r"weights: 4-bit float values are not implemented \(8-bit float\)"),
    (lambda c: _group(c).update(output_activations={"num_bits": 8, "type": "float"}),
     "output_activations is not implemented"),
    (lambda c: _group(c)["input_activations"].update(dynamic=False),
     "input_activations: dynamic False with strategy 'token' is not implemented"),
    (lambda c: _group(c)["weights"].update(strategy="block", block_structure=[32]),
     r"block_structure \[32\] is not two positive integers"),
    (lambda c: _group(c).update(format="nvfp4-pack-quantized"),
     "format 'nvfp4-pack-quantized' of FP8 weights is not implemented"),
    (lambda c: c["config_groups"].update(group_1={"targets": ["re:.*down_proj"], "weights": {
        "num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}),
     "both FP8 and integer weights are not implemented"),
])
def test_what_a_compressed_tensors_fp8_config_asks_beyond_this_engine_is_refused(
        tiny_llama_dir, tmp_path, change, message):
    made = write_fp8(tiny_llama_dir, tmp_path / "made")
    path = _with_config(made, tmp_path / "changed", change)
    with pytest.raises(ValueError, match=message):
        check_quantization(path, None)


@pytest.mark.parametrize("changes, message", [
    (dict(fmt="e5m2"), "fmt 'e5m2' is not implemented"),
    (dict(activation_scheme="per-channel"), "activation_scheme 'per-channel'"),
    (dict(activation_scheme="static"), "static activation scales with weight_block_size"),
    (dict(weight_block_size=[128]), r"weight_block_size \[128\] is not two positive"),
])
def test_what_an_fp8_method_config_asks_beyond_this_engine_is_refused(
        tiny_llama_dir, tmp_path, changes, message):
    made = as_fp8_method(write_fp8(tiny_llama_dir, tmp_path / "ct", "block", "group"),
                         tmp_path / "made")
    path = _with_config(made, tmp_path / "changed", lambda c: c.update(changes))
    with pytest.raises(ValueError, match=message):
        check_quantization(path, None)
    with pytest.raises(ValueError, match="--quantization gptq does not apply"):
        check_quantization(made, "gptq")
    check_quantization(made, "fp8")


def test_a_weight_without_its_scale_is_named(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    path = write_fp8(tiny_llama_dir, tmp_path / "fp8")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight_scale"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj: the checkpoint holds an "
                                         "FP8 weight without its scale"):
        load_model(path, torch.float32, "cpu", select_backend("cpu"))


def test_routed_experts_whose_inputs_are_rounded_are_refused_by_name(tiny_moe_dirs, tmp_path):
    """Qwen3-MoE's FP8 release rounds its experts' inputs too: not yet computed here."""
    from fp8_files import write_fp8_method

    path = write_fp8_method(tiny_moe_dirs["qwen3_moe"], tmp_path / "fp8")
    with pytest.raises(ValueError, match=r"FP8 activations of model\.layers\.\d+\.mlp\.experts"
                                         r"\.\d+\.\w+ are not implemented"):
        load_model(path, torch.float32, "cpu", select_backend("cpu"))
