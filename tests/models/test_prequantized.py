"""Checkpoints quantized before they were saved (GPTQ, AWQ, compressed-tensors' pack-quantized)
against transformers on the same weights dequantized (``prequantized_files``), judged as the
GGUF files are (``quantized_oracle``); the blocks they load into against the ``gguf``
package's dequantization; and what is refused, by name."""

from __future__ import annotations

import json
import shutil

import gguf
import pytest
import torch
from paged_contexts import PagedContexts
from prequantized_files import write, write_compressed_tensors
from quantized_oracle import check_greedy_and_kl

from actorlm.kernels import QuantizedWeight, select_backend
from actorlm.models import prequantized
from actorlm.models.loader import check_quantization, load_model
from actorlm.models.prequantized import Grouped, as_weight


def _gguf_dequantized(weight: QuantizedWeight) -> torch.Tensor:
    kind = gguf.GGMLQuantizationType[weight.type_name]
    return torch.from_numpy(gguf.quants.dequantize(weight.blocks.numpy(), kind)) \
        .view(weight.shape)


@pytest.mark.parametrize("bits, symmetric, type_name", [
    (4, True, "Q4_0"), (4, False, "Q4_1"), (8, True, "Q8_0"), (8, False, "Q8_0")])
def test_blocks_hold_what_the_integers_say(bits, symmetric, type_name):
    """s * (q - z) by groups of 64 inputs, in blocks that ``gguf`` dequantizes to the same
    values: exactly, but Q4_1's offset m = -s * z, which rounds to fp16 (half an fp16 ulp of
    it at most)."""
    torch.manual_seed(0)
    values = torch.randint(0, 2**bits, (8, 256), dtype=torch.uint8)
    zeros = None if symmetric else torch.randint(0, 2**bits, (8, 4), dtype=torch.uint8)
    if bits == 8 and not symmetric:  # where every q - z fits an int8
        zeros = torch.full((8, 4), 127, dtype=torch.uint8)
        values = values.clamp(max=254)
    scales = (torch.rand(8, 4) * 0.01 + 1e-3).half()
    grouped = Grouped(values, zeros, scales, bits)
    weight, kind = as_weight(grouped, torch.float32, copied=False)
    assert kind == weight.type_name == type_name
    expected = grouped.dense()
    ours = _gguf_dequantized(weight)
    if type_name == "Q4_1":
        offset = (scales.float() * zeros.float()).repeat_interleave(64, dim=1)
        bound = offset * 2.0**-11 + 1e-7
        assert ((ours - expected).abs() <= bound).all()
    else:
        assert torch.equal(ours, expected)


@pytest.mark.parametrize("case, why", [
    ("2 bits", "2-bit values"), ("groups of 16", "groups of 16 features"),
    ("act-order", "not consecutive runs"), ("wide zeros", "outside int8's range")])
def test_what_no_block_holds_is_dequantized_exactly(case, why):
    torch.manual_seed(1)
    bits = {"2 bits": 2, "wide zeros": 8}.get(case, 4)
    groups = 16 if case == "groups of 16" else 4
    values = torch.randint(0, 2**bits, (8, 256), dtype=torch.uint8)
    zeros = torch.randint(0, 2**bits, (8, groups), dtype=torch.uint8)
    scales = torch.rand(8, groups).half()
    group_of = torch.randperm(256) % groups if case == "act-order" else None
    grouped = Grouped(values, zeros, scales, bits, group_of)
    weight, kind = as_weight(grouped, torch.float32)
    assert kind.startswith("dense") and why in kind
    index = group_of if group_of is not None else torch.arange(256) // (256 // groups)
    expected = (values.float() - zeros[:, index].float()) * scales[:, index].float()
    assert torch.equal(weight, expected)


CHECKPOINTS = {  # name -> (writer's arguments, the block type of every projection)
    "gptq-4bit-sym": (dict(method="gptq"), "Q4_0"),
    "gptq-4bit-asym": (dict(method="gptq", symmetric=False), "Q4_1"),
    "gptq_v2-4bit-asym": (dict(method="gptq_v2", symmetric=False, group=64), "Q4_1"),
    "gptq-8bit-sym": (dict(method="gptq", bits=8), "Q8_0"),
    "gptq-act-order": (dict(method="gptq", shuffled_groups=True), None),
    "awq": (dict(method="awq", symmetric=False), "Q4_1"),
}


def _projections(model):
    return [m.prepared for layer in model.model.layers
            for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                      layer.mlp.down_proj)]


def _check(quantized_dir, dense_dir, type_name):
    from transformers import AutoModelForCausalLM

    ours = load_model(quantized_dir, torch.float32, "cpu", select_backend("cpu"))
    kinds = {getattr(p, "_kinds", [(type(p).__name__, None)])[0][0]
             for p in _projections(ours)}
    assert kinds == {type_name} if type_name else "QuantLinear" not in kinds, kinds
    theirs = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    check_greedy_and_kl(ours, theirs)


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_a_gptq_or_awq_checkpoint_matches_transformers_on_its_weights(
        name, tiny_llama_dir, tmp_path):
    arguments, type_name = CHECKPOINTS[name]
    _check(*write(tiny_llama_dir, tmp_path, **arguments), type_name)


@pytest.mark.parametrize("arguments, type_name", [
    (dict(), "Q4_0"), (dict(symmetric=False, strategy="channel"), "Q4_1"),
    (dict(bits=8, group=64), "Q8_0")], ids=["w4a16-group", "w4a16-asym-channel", "w8a16"])
def test_a_compressed_tensors_checkpoint_matches_transformers_on_its_weights(
        arguments, type_name, tiny_qwen2_dir, tmp_path):
    _check(*write_compressed_tensors(tiny_qwen2_dir, tmp_path, **arguments), type_name)


def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    meta = json.loads((dst / "config.json").read_text())
    meta["quantization_config"] = {**meta["quantization_config"], **changes}
    (dst / "config.json").write_text(json.dumps(meta))
    return dst


def test_a_damaged_module_and_a_config_that_is_no_object_are_named(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    quantized_dir, _ = write(tiny_llama_dir, tmp_path, method="gptq")
    tensors = load_file(quantized_dir / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.scales"
    tensors[name] = tensors[name][:, :40].contiguous()  # scales for 40 of 64 outputs
    save_file(tensors, quantized_dir / "model.safetensors")
    with pytest.raises(ValueError, match=r"o_proj: scales \(40, 2\) for a weight 64 x 64"):
        load_model(quantized_dir, torch.float32, "cpu", select_backend("cpu"))
    meta = json.loads((quantized_dir / "config.json").read_text())
    (quantized_dir / "config.json").write_text(json.dumps({**meta, "quantization_config": "x"}))
    with pytest.raises(ValueError, match="quantization_config must be an object, got 'x'"):
        check_quantization(quantized_dir, None)


@pytest.mark.parametrize("changes, message", [
    (dict(quant_method="hqq"), "quant_method 'hqq' is not implemented"),
    (dict(quant_method="bitsandbytes"), "quant_method 'bitsandbytes' is not implemented"),
    (dict(bits=3), "bits 3 is not implemented"),
    (dict(dynamic={"-:.*down_proj": {}}), "dynamic"),
    (dict(checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
])
def test_what_a_gptq_config_asks_beyond_this_engine_is_refused_by_name(
        tiny_llama_dir, tmp_path, changes, message):
    quantized_dir, _ = write(tiny_llama_dir, tmp_path / "made", method="gptq")
    path = _with_config(quantized_dir, tmp_path / "changed", **changes)
    with pytest.raises(ValueError, match=message):
        check_quantization(path, None)


def test_quantized_activations_and_a_contradicting_flag_are_refused(tiny_qwen2_dir, tmp_path):
    quantized_dir, _ = write_compressed_tensors(tiny_qwen2_dir, tmp_path / "made")
    config = prequantized.quantization_config(quantized_dir)
    group = config["config_groups"]["group_0"]
    fp8 = {**group, "input_activations": {"num_bits": 8, "type": "float", "dynamic": True}}
    path = _with_config(quantized_dir, tmp_path / "w4a8", config_groups={"group_0": fp8})
    with pytest.raises(ValueError, match="group_0.input_activations is not implemented"):
        check_quantization(path, None)
    check_quantization(quantized_dir, "compressed-tensors")
    with pytest.raises(ValueError, match="--quantization q8_0 does not apply"):
        check_quantization(quantized_dir, "q8_0")


def test_a_module_missing_a_tensor_is_named(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    quantized_dir, _ = write(tiny_llama_dir, tmp_path, method="awq", symmetric=False)
    tensors = load_file(quantized_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.qzeros"]
    save_file(tensors, quantized_dir / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj: the checkpoint lacks "
                                         "qzeros"):
        load_model(quantized_dir, torch.float32, "cpu", select_backend("cpu"))


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_routed_experts_are_read_one_module_each(family, tiny_moe_dirs, tmp_path):
    """Each expert's projections (Mixtral's under w1/w2/w3) read as modules of their own:
    through the dense path (groups of 16, act-order) the logits are transformers' on the same
    weights; in blocks, every routed layer holds its experts in them. (The blocks' int8
    activations move the routers' scores enough to flip near-tied experts on these tiny random
    routers, so the blocks' logits are held to transformers by the GGUF MoE tests' rule, not
    here.)"""
    from transformers import AutoModelForCausalLM

    from actorlm.kernels.moe import LinearExperts
    from actorlm.models.moe import SparseMoeBlock

    dense_path, oracle = write(tiny_moe_dirs[family], tmp_path / "act-order", method="gptq",
                               group=16, symmetric=False, shuffled_groups=True)
    ours = load_model(dense_path, torch.float32, "cpu", select_backend("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32).eval()
    prompt = list(range(3, 23))
    with torch.inference_mode():
        expected = theirs(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(PagedContexts(ours).step(ours, [(0, prompt)]), expected,
                               atol=2e-4, rtol=0)
    blocks_path, _ = write(tiny_moe_dirs[family], tmp_path / "blocks", method="gptq")
    ours = load_model(blocks_path, torch.float32, "cpu", select_backend("cpu"))
    routed = [layer.mlp.experts.prepared for layer in ours.model.layers
              if isinstance(layer.mlp, SparseMoeBlock)]
    assert routed and all(isinstance(p, LinearExperts) for p in routed), routed
    kinds = {linear._kinds[0][0] for p in routed for linear in (*p.gate_up, *p.down)}
    assert kinds == {"Q4_0"}


@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tiny_moe_dirs, tmp_path_factory):
    from mxfp4_files import write_mxfp4

    return write_mxfp4(tiny_moe_dirs["gpt_oss"], tmp_path_factory.mktemp("mx") / "gpt_oss")


def _transformers_mxfp4(path, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    return AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, quantization_config=Mxfp4Config(dequantize=True)).eval()


def test_mxfp4_experts_become_q5_0_blocks_of_the_very_values_transformers_reads(gpt_oss_mxfp4):
    """Every expert's gate, up and down in Q5_0 blocks that ``gguf`` dequantizes to exactly
    transformers' dequantization of the MXFP4 checkpoint (gate and up: its even and odd
    features)."""
    from safetensors.torch import load_file

    from actorlm.models import mxfp4

    theirs = _transformers_mxfp4(gpt_oss_mxfp4)
    [file] = gpt_oss_mxfp4.glob("*.safetensors")
    weights = dict(mxfp4.read_tensors(load_file(file).items(), torch.float32))
    checked = 0
    for i, layer in enumerate(theirs.model.layers):
        gate_up = layer.mlp.experts.gate_up_proj.detach().transpose(1, 2)  # [E, 2I, H]
        down = layer.mlp.experts.down_proj.detach().transpose(1, 2)  # [E, H, I]
        for e in range(gate_up.shape[0]):
            for name, expected in (("gate_proj", gate_up[e, 0::2]), ("up_proj", gate_up[e, 1::2]),
                                   ("down_proj", down[e])):
                weight = weights[f"model.layers.{i}.mlp.experts.{e}.{name}.weight"]
                assert weight.type_name == "Q5_0"
                assert torch.equal(_gguf_dequantized(weight), expected)
                checked += 1
    assert checked == 2 * 8 * 3


def test_an_mxfp4_checkpoint_matches_transformers_on_its_weights(gpt_oss_mxfp4):
    from actorlm.kernels.moe import LinearExperts

    ours = load_model(gpt_oss_mxfp4, torch.float32, "cpu", select_backend("cpu"))
    assert all(isinstance(layer.mlp.experts.prepared, LinearExperts)
               for layer in ours.model.layers)
    check_greedy_and_kl(ours, _transformers_mxfp4(gpt_oss_mxfp4))


def test_a_scale_fp16_cannot_hold_dequantizes_the_weight_exactly():
    """2^-30 (an E8M0 scale of 98) is below fp16's subnormals: that weight is served dense."""
    values = torch.randint(4, 29, (4, 64), dtype=torch.uint8)
    scales = torch.tensor([[2.0**-30, 2.0**-3]] * 4)
    weight, kind = as_weight(Grouped(values, None, scales, 5), torch.float32)
    assert kind == "dense (scales fp16 does not hold exactly)"
    assert torch.equal(weight, Grouped(values, None, scales, 5).dense())
