"""Mixtures of experts from GGUF files, and routed experts in GGUF blocks.

Tiny checkpoints of each family, every layer routed (``gguf_moe_files.save_routed``), written
as llama.cpp lays MoE files out (``write_moe_gguf``). A file in F32 must be its checkpoint:
transformers' logits on the checkpoint to fp32 rounding (the names, the shapes, Mixtral's
permuted q/k and the config built from the metadata are right). A file in blocks keeps its
experts in them, each expert's layers on the quantized kernels, and is judged as quantized
models are (``test_gguf.py``): the mean KL divergence of the next-token distribution over a
prompt and its greedy continuation against transformers over the same dequantized weights, and
vLLM's ``check_logprobs_close`` on the greedy tokens. The oracle reads the file itself for
Qwen3-MoE and Qwen2-MoE (``transformers_on_gguf``); for Mixtral, OLMoE and Granite MoE, whose
files transformers does not read as mixtures of experts, it is the checkpoint with its matrices
quantized and dequantized by gguf as the file stores them (``dequantized_moe``; checked
against the file here). The K formats' blocks are random (gguf cannot quantize them), in
Q6_K: Q4_K's and Q5_K's random blocks have a positive mean that drowns every position's
signal (the experts' kernels take those formats in ``tests/kernels/test_quant_experts.py``).

``--quantization`` puts a safetensors checkpoint's experts in blocks too: the test holds the
blocks' values to gguf's quantization of transformers' weights; their kernels are the files'
(a Q8_0 model quantized at load computes what its Q8_0 file computes). Splits that would cut
an expert's blocks are refused before loading; 2 ranks, by features or by whole experts,
compute in blocks what one does.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf_moe_files import dequantized_moe, save_routed, transformers_on_gguf, write_moe_gguf
from greedy import check_logprobs_close, hf_continuation
from paged_contexts import PagedContexts, greedy_with_logits, random_prompt
from quantized_oracle import MAX_MEAN_KL, mean_kl
from tp_helpers import run_ranks
from tp_steps import assert_alike_but_for_int8_steps, experts_placement, greedy_steps

from actorlm.config import EngineConfig
from actorlm.kernels import QuantizedWeight, moe, portable, select_backend
from actorlm.models import expert_weights, quantized
from actorlm.models.loader import load_hf_config, load_model, resolve_model
from actorlm.models.moe import SparseMoeBlock
from actorlm.models.moe_families import experts_as_held, moe_specs
from actorlm.models.parallel import TensorParallel
from actorlm.models.parts import load_model_parts

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe"]
READ_BY_TRANSFORMERS = ("qwen3_moe", "qwen2_moe")
MAX_MEAN_KL_AFTER_A_DIFFERENCE = 0.03  # (see _check_close_where_routed_alike)
PROMPT_LEN, NUM_DECODED = 20, 12


@pytest.fixture(scope="module")
def routed_dirs(tmp_path_factory, tiny_tokenizer_dir):
    return {family: save_routed(tmp_path_factory, tiny_tokenizer_dir, family)
            for family in [*FAMILIES, "qwen3_moe_k", "glm4_moe", "ernie4_5_moe"]}


@pytest.fixture(scope="module")
def gguf_files(routed_dirs, tmp_path_factory):
    """(family, type) -> the file, written on first use."""
    written = {}
    folder = tmp_path_factory.mktemp("moe_gguf")

    def file(family, type_name):
        if (family, type_name) not in written:
            written[family, type_name] = write_moe_gguf(
                routed_dirs[family], folder / f"{family}-{type_name}.gguf", type_name)
        return written[family, type_name]
    return file


def _load(path, **flags):
    return load_model(path, torch.float32, "cpu", select_backend("cpu"), **flags)


def _blocks(model) -> list:
    return [layer.mlp.experts for layer in model.model.layers
            if isinstance(layer.mlp, SparseMoeBlock)]


def _logits_and_greedy(model, prompt):
    """(our logits at every position of the prompt and its greedy continuation, the tokens,
    each step's top 5, the experts each routed layer chose at each position [T, k])."""
    choices = []
    blocks = [layer.mlp for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    hooks = [block.gate.register_forward_hook(
        lambda module, args, logits, j=j: choices.append((j, logits.topk(top_k).indices)))
        for j, block in enumerate(blocks) for top_k in [block.spec.top_k]]
    try:
        logits, tokens, tops = greedy_with_logits(model, prompt, NUM_DECODED, block_size=4)
    finally:
        for hook in hooks:
            hook.remove()
    routed = [torch.cat([ids for j2, ids in choices if j2 == j]).sort(-1).values
              for j in range(len(blocks))]
    return logits, tokens, tops, routed


def _their_logits(model, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """transformers' logits over ``ids`` and the experts each of its routers chose [T, k]."""
    choices = []
    routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    hooks = [router.register_forward_hook(
        lambda module, args, out: choices.append(out[2][-len(ids):].sort(-1).values))
        for router in routers]
    try:
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0]
    finally:
        for hook in hooks:
            hook.remove()
    return logits, choices



def _check_close_where_routed_alike(ours, our_routes, expected, their_routes, what: str):
    """The kernels' int8 activations move a router's scores by about a percent, so a token
    whose k-th and (k+1)-th experts score closer than that may take either (as bf16's roundings
    do: ``test_moe_families``), and its distribution follows the experts it took; the later
    positions then attend to its different values. So: at least 3 positions in 4 route alike
    (every layer choosing the same experts on both sides); the positions before the first that
    does not, whose whole context routed alike, are held to ``MAX_MEAN_KL``; the others routed
    alike to ``MAX_MEAN_KL_AFTER_A_DIFFERENCE``."""
    alike = torch.stack([(a == b).all(-1) for a, b in zip(our_routes, their_routes,
                                                          strict=True)]).all(0)
    first = int((~alike).nonzero()[0]) if not alike.all() else len(alike)
    before, after = mean_kl(expected[:first], ours[:first]), \
        mean_kl(expected[first:][alike[first:]], ours[first:][alike[first:]])
    print(f"{what}: mean KL {before:.5f} nats over the {first} positions before a routing "
          f"difference, {after:.5f} over the {int(alike[first:].sum())} after it routed "
          f"alike, {len(alike) - int(alike.sum())} of {len(alike)} routed differently "
          f"(all: {mean_kl(expected, ours):.5f})")
    assert alike.float().mean() >= 0.75
    # (a mean over no positions is nan: nothing to hold)
    assert not before > MAX_MEAN_KL and not after > MAX_MEAN_KL_AFTER_A_DIFFERENCE


@pytest.mark.parametrize("family", [*FAMILIES, "glm4_moe", "ernie4_5_moe"])
def test_an_f32_file_is_its_checkpoint(family, routed_dirs, gguf_files):
    from transformers import AutoModelForCausalLM

    cached = resolve_model(gguf_files(family, "F32"))
    assert moe_specs(load_hf_config(cached)) == moe_specs(load_hf_config(routed_dirs[family]))
    ours = _load(cached)
    prompt = random_prompt(ours.vocab_size, PROMPT_LEN)
    logits, tokens, _, _ = _logits_and_greedy(ours, prompt)
    theirs = AutoModelForCausalLM.from_pretrained(routed_dirs[family],
                                                  dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = theirs(torch.tensor([prompt + tokens[:-1]])).logits[0]
    torch.testing.assert_close(logits, expected, atol=2e-4, rtol=0)


def test_a_glm_files_draft_layer_is_left_out(routed_dirs, tmp_path):
    """A GLM-4.5 file counts its multi-token-prediction layer in ``block_count`` and holds it
    after the others (``nextn`` tensors beside a layer's): the model is the layers before it."""
    from gguf_moe_files import write_moe_gguf

    with_draft = resolve_model(write_moe_gguf(routed_dirs["glm4_moe"], tmp_path / "mtp.gguf",
                                              "F32", draft_layer=True))
    config = load_hf_config(with_draft)
    assert config.num_hidden_layers == 2 and config.first_k_dense_replace == 1
    assert (config.routed_scaling_factor, config.n_group, config.topk_group) == (2.5, 2, 1)
    ours = _load(with_draft)
    plain = _load(resolve_model(write_moe_gguf(routed_dirs["glm4_moe"], tmp_path / "p.gguf",
                                               "F32")))
    prompt = random_prompt(ours.vocab_size, PROMPT_LEN)
    assert torch.equal(_logits_and_greedy(ours, prompt)[0], _logits_and_greedy(plain, prompt)[0])


@pytest.mark.parametrize("family, type_name", [
    *((family, type_name) for family in FAMILIES for type_name in ("Q8_0", "Q4_0")),
    ("qwen3_moe_k", "Q6_K")])
def test_a_file_in_blocks_keeps_its_experts_in_them_and_matches_transformers(
        family, type_name, routed_dirs, gguf_files):
    file = gguf_files(family, type_name)
    ours = _load(resolve_model(file))
    for experts in _blocks(ours):  # no dense copy: each expert's layers on the kernels
        assert isinstance(experts.prepared, moe.LinearExperts)
        assert experts.prepared.type_names == [type_name]
        assert experts.gate_up_proj is None and experts.down_proj is None
        assert type(experts.prepared.down[0]).__name__ == "QuantLinear"
    # the one-call decode step takes no experts in blocks: the layers run in Python
    assert ours.decode_step is None
    prompt = random_prompt(ours.vocab_size, PROMPT_LEN)
    logits, tokens, tops, routes = _logits_and_greedy(ours, prompt)
    base = family.removesuffix("_k")
    theirs = transformers_on_gguf(file) if base in READ_BY_TRANSFORMERS else \
        dequantized_moe(routed_dirs[family], type_name)
    expected, their_routes = _their_logits(theirs, prompt + tokens[:-1])
    _check_close_where_routed_alike(logits, routes, expected, their_routes,
                                    f"{family} {type_name}")
    check_logprobs_close([(tokens, tops)], [hf_continuation(theirs, prompt, NUM_DECODED)])


@pytest.mark.parametrize("experts_in", ["F32", "MXFP4"])
def test_a_gpt_oss_file_is_its_checkpoint(experts_in, tiny_moe_dirs, tmp_path):
    """llama.cpp's layout of GPT-OSS (experts' gate and up apart, their biases, the sinks,
    YaRN and the window from the metadata): in F32 it is its checkpoint to fp32 rounding; its
    experts in MXFP4 load as Q5_0 blocks of the same values, judged as blocks are, against
    the checkpoint holding those values."""
    from gguf_moe_files import write_gpt_oss_gguf
    from transformers import AutoModelForCausalLM

    path = tiny_moe_dirs["gpt_oss"]
    file, state = write_gpt_oss_gguf(path, tmp_path / f"gpt-oss-{experts_in}.gguf", experts_in)
    ours = _load(resolve_model(file))
    assert moe_specs(load_hf_config(resolve_model(file))) == moe_specs(load_hf_config(path))
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    theirs.load_state_dict(state)
    prompt = random_prompt(ours.vocab_size, PROMPT_LEN)
    logits, tokens, tops, routes = _logits_and_greedy(ours, prompt)
    expected, their_routes = _their_logits(theirs, prompt + tokens[:-1])
    if experts_in == "F32":
        torch.testing.assert_close(logits, expected, atol=2e-4, rtol=0)
        return
    assert all(experts.prepared.type_names == ["Q5_0"] for experts in _blocks(ours))
    _check_close_where_routed_alike(logits, routes, expected, their_routes, "gpt-oss MXFP4")
    check_logprobs_close([(tokens, tops)], [hf_continuation(theirs, prompt, NUM_DECODED)])


@pytest.mark.parametrize("magnitude, type_name", [(1.0, "Q5_0"), (1e-9, "dense")])
def test_a_files_mxfp4_blocks_become_q5_0_blocks_of_the_same_values(magnitude, type_name):
    """ggml's MXFP4 blocks (the E8M0 scale, then values 0-15 in the low nibbles, 16-31 in the
    high ones) as Q5_0 blocks that gguf reads back to its own MXFP4 values, bit for bit; where
    a scale is below what fp16 holds (weights of 1e-9), the weight dequantized, as exactly."""
    import gguf

    from actorlm.models import mxfp4
    from actorlm.models.prequantized import as_weight

    rows = (np.random.default_rng(0).standard_normal((6, 96)) * magnitude).astype(np.float32)
    kind = gguf.GGMLQuantizationType.MXFP4
    blocks = gguf.quants.quantize(rows, kind)
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, kind))
    weight, why = as_weight(mxfp4.gguf_grouped(torch.from_numpy(blocks), 6), torch.float32)
    if type_name == "dense":
        assert why == "dense (scales fp16 does not hold exactly)"
        assert torch.equal(weight, expected)
        return
    assert weight.type_name == "Q5_0"
    ours = gguf.quants.dequantize(weight.blocks.numpy(), gguf.GGMLQuantizationType.Q5_0)
    assert torch.equal(torch.from_numpy(ours), expected)


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "granitemoe"])
def test_the_dequantized_oracle_holds_what_the_file_holds(family, routed_dirs, gguf_files):
    import gguf

    reader = gguf.GGUFReader(gguf_files(family, "Q4_0"))
    stored = {t.name: gguf.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    theirs = dequantized_moe(routed_dirs[family], "Q4_0")
    layer = theirs.model.layers[1]
    mlp = getattr(layer, "mlp", None) or layer.block_sparse_moe
    gate_up = mlp.experts.gate_up_proj.detach().numpy()  # [E, 2I, H]
    size = gate_up.shape[1] // 2
    np.testing.assert_array_equal(gate_up[:, :size], stored["blk.1.ffn_gate_exps.weight"])
    np.testing.assert_array_equal(gate_up[:, size:], stored["blk.1.ffn_up_exps.weight"])
    np.testing.assert_array_equal(mlp.experts.down_proj.detach().numpy(),
                                  stored["blk.1.ffn_down_exps.weight"])
    np.testing.assert_array_equal(layer.self_attn.v_proj.weight.detach().numpy(),
                                  stored["blk.1.attn_v.weight"])


def test_experts_in_blocks_beside_experts_in_floats_run_in_floats(routed_dirs, gguf_files,
                                                                  caplog):
    """A layer whose experts came partly in blocks (a format without kernels is dequantized at
    load) runs all of them in floats, with the same values."""
    import logging

    model_dir = resolve_model(gguf_files("qwen3_moe", "Q8_0"))
    whole = _load(model_dir)

    def half_dequantized(tensors):
        for name, tensor in tensors:
            if ".experts." in name and "down_proj" in name:
                tensor = portable.dequantize(tensor, torch.float32)
            yield name, tensor

    from actorlm.models import gguf_file
    from actorlm.models.causal_lm import CausalLM

    config = load_hf_config(model_dir)
    mixed = CausalLM(config, select_backend("cpu"))
    with caplog.at_level(logging.INFO, logger="actorlm.models.moe"):
        mixed.load_weights(half_dequantized(gguf_file.read_tensors(model_dir, config,
                                                                   torch.float32)))
    assert any("both in blocks and in floats" in r.getMessage() for r in caplog.records)
    assert not any(isinstance(e.prepared, moe.LinearExperts) for e in _blocks(mixed))
    prompt = random_prompt(whole.vocab_size, PROMPT_LEN)
    ours = PagedContexts(mixed).step(mixed, [(0, prompt)])
    assert mean_kl(PagedContexts(whole).step(whole, [(0, prompt)]), ours) <= MAX_MEAN_KL


def test_stacked_experts_in_blocks_are_refused_by_name():
    weight = QuantizedWeight("Q8_0", torch.zeros(4, 34, dtype=torch.uint8), (4, 32))
    with pytest.raises(ValueError, match="one expert at a time"):
        expert_weights.expert_parts("model.layers.0.mlp.experts.down_proj", weight, {},
                                    TensorParallel())


# --- --quantization on a safetensors mixture of experts ----------------------------------------


def _quantized_like_the_engine(hf_dir, quantization: str):
    """transformers' model of ``hf_dir`` with what ``--quantization`` quantizes quantized and
    dequantized by gguf: every matrix whose rows divide into blocks (the vocabulary in Q8_0),
    the experts' too, but the routers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2 or name.endswith((".gate.weight", "shared_expert_gate.weight",
                                                 ".router.weight", "_bias")):
                continue  # (GPT-OSS's experts' biases are [E, out]: no matrices)
            vocabulary = "embed_tokens" in name or "lm_head" in name
            # (GPT-OSS's experts [E, in, out]: blocks along the inputs)
            inputs_first = name.endswith((".experts.gate_up_proj", ".experts.down_proj")) and \
                model.config.model_type == "gpt_oss"
            values = param.transpose(1, 2) if inputs_first else param
            rows = values.reshape(-1, values.shape[-1])
            blocks = quantized.quantize(rows, quantization, vocabulary)
            if blocks is not None:
                values.copy_(portable.dequantize(blocks, torch.float32).view(values.shape))
    return model


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_moe_stacked", "qwen2_moe", "mixtral",
                                    "olmoe", "gpt_oss"])
def test_quantization_puts_the_experts_in_blocks_too(family, quantization, tiny_moe_dirs):
    """tests/checkpoints.py's MoE checkpoints (a dense layer among Qwen3-MoE's, Qwen2-MoE's
    shared expert, experts saved stacked, GPT-OSS's stacked [E, in, out] with gate and up
    interleaved) under ``--quantization``: every routed expert in blocks, the routers in
    floats, and the blocks hold what transformers' weights quantized and dequantized by gguf
    hold (the model over their values, in floats, is transformers' over them to fp32
    rounding)."""
    path = tiny_moe_dirs[family]
    ours = _load(path, quantization=quantization)
    for experts in _blocks(ours):
        assert isinstance(experts.prepared, moe.LinearExperts)
        assert experts.prepared.type_names == [quantization.upper()]
    for layer in ours.model.layers:
        if isinstance(layer.mlp, SparseMoeBlock):
            assert type(layer.mlp.gate.prepared).__name__ != "QuantLinear"
    from actorlm.models.causal_lm import CausalLM
    from actorlm.models.loader import _safetensors

    values = CausalLM(load_hf_config(path), select_backend("cpu"))
    values.load_weights((name, portable.dequantize(tensor, torch.float32)
                         if isinstance(tensor, QuantizedWeight) else tensor)
                        for name, tensor in quantized.quantize_checkpoint(
                            experts_as_held(values.config, _safetensors(path, sliced=False)),
                            quantization))
    prompt = random_prompt(ours.vocab_size, PROMPT_LEN)
    expected, _ = _their_logits(_quantized_like_the_engine(path, quantization), prompt)
    torch.testing.assert_close(PagedContexts(values).step(values, [(0, prompt)]), expected,
                               atol=2e-4, rtol=0)


# --- splits ----------------------------------------------------------------------------------


def test_a_split_that_cuts_an_experts_blocks_is_refused_before_loading(gguf_files,
                                                                       tiny_moe_dirs):
    # Mixtral's experts have 32 features: 2 ranks would take 16 columns of a 32-value block
    file = str(gguf_files("mixtral", "Q8_0"))
    with pytest.raises(ValueError, match="--tensor-parallel-size 2.*Q8_0's 32-value blocks"):
        load_model_parts(EngineConfig(model=file, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="--tensor-parallel-size 2.*Q4_0's 32-value blocks"):
        load_model_parts(EngineConfig(model=str(tiny_moe_dirs["mixtral"]),
                                      tensor_parallel_size=2, quantization="q4_0"))
    # whole experts on each rank cut nothing
    for model, quantization in ((file, None), (str(tiny_moe_dirs["mixtral"]), "q4_0")):
        load_model_parts(EngineConfig(model=model, tensor_parallel_size=2,
                                      enable_expert_parallel=True, quantization=quantization))


def _split_ranks(tp: TensorParallel, paths: dict) -> dict:
    """On each rank: ``greedy_steps`` over each file with every expert's features split, and
    with the experts placed whole."""
    expert_parallel = dataclasses.replace(tp, expert_parallel=True)
    return {(name, how): greedy_steps(rank_tp, path) for name, path in paths.items()
            for how, rank_tp in (("tp", tp), ("ep", expert_parallel))}


def test_two_ranks_compute_in_blocks_what_one_computes(gguf_files):
    """Experts in blocks split over 2 ranks, by their features (a down projection's columns
    on a block boundary: the same activation blocks as on one rank) and whole: rank 0's
    tokens are one rank's, its logits within fp32 rounding of them but for the odd row
    (``assert_alike_but_for_int8_steps``: one row of 27 in the expert-parallel run on a
    Zen 4)."""
    paths = {name: resolve_model(gguf_files(*name.split(":")))
             for name in ("qwen3_moe:Q8_0", "qwen2_moe:Q4_0")}
    split = run_ranks(_split_ranks, 2, paths, timeout=300)
    for name, path in paths.items():
        whole = greedy_steps(TensorParallel(), path)
        for how in ("tp", "ep"):
            ours = split[0][name, how]
            assert ours["tokens"] == whole["tokens"], (name, how)
            assert_alike_but_for_int8_steps(ours["logits"], whole["logits"], (name, how))
        # (the router's id of the first expert, experts held, features of each)
        assert [split[rank][name, "tp"]["experts"] for rank in range(2)] == [[(0, 8, 32)] * 2] * 2
        assert [split[rank][name, "ep"]["experts"] for rank in range(2)] == \
            [[(4 * rank, 4, 64)] * 2 for rank in range(2)]
        assert experts_placement(_load(path)) == [(0, 8, 64)] * 2
