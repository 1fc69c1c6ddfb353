"""The families beyond Llama's (Gemma 3, Gemma 2, Mistral and Qwen2 with their windows, Phi-3,
SmolLM3 without RoPE in a layer, Granite's multipliers, OLMo 2's and 3's output norms, GLM's
RoPE on half of each head in interleaved pairs, Phi-3's on three quarters and LongRoPE's short
factors, ERNIE 4.5's and Helium's interleaved pairs, EXAONE 4's global NoPE, Seed-OSS's biases,
Gemma's, Ministral's and Ministral 3's, StableLM's LayerNorms with a gated MLP, sequential and
in parallel, Nemotron's and Arcee's ReLU squared, GPT-NeoX's per-head q/k/v and two norms in
parallel, Falcon's three layouts of q/k/v and branches, OLMo's LayerNorms without weights and
its clipped q/k/v, GPT-BigCode's one KV head)
against transformers on the same tiny checkpoints: logits at every position of a 40-token
prompt and 60 greedy tokens after it, far past the window of 16, and the greedy tokens
themselves by vLLM's rule."""

from __future__ import annotations

import json

import pytest
import torch
from checkpoints import LONGROPE_CONTEXT, TEXT_TOWERS, WINDOW, save_multimodal
from greedy import check_logprobs_close, hf_continuation
from paged_contexts import greedy_with_logits, random_prompt

from actorlm.kernels import select_backend
from actorlm.kernels.cpu import linear as cpu_linear
from actorlm.models.loader import load_model

FAMILIES = ["gemma", "gemma3", "gemma2", "mistral", "qwen2_window", "phi3", "smollm3", "granite",
            "olmo2", "olmo3", "glm", "glm4", "phi3_partial", "phi3_longrope", "ernie4_5",
            "exaone4", "helium", "seed_oss", "ministral", "ministral3"]
# LayerNorm, parallel branches, ungated MLPs
LAYER_NORM_FAMILIES = ["starcoder2", "phi", "cohere", "cohere2", "opt", "gpt2", "stablelm",
                       "stablelm_parallel", "nemotron", "arcee", "gpt_neox",
                       "gpt_neox_sequential", "falcon", "falcon_new", "falcon_sequential",
                       "olmo", "gpt_bigcode", "gpt_bigcode_mha"]
# each head's q and k through a LayerNorm before RoPE, or an RMS norm after it (Hunyuan's):
# the one-call decode step has neither
HEAD_NORM_FAMILIES = ["stablelm_qk_norm", "cohere_qk_norm", "phi_qk_norm"]
LAYER_BY_LAYER_FAMILIES = [*HEAD_NORM_FAMILIES, "hunyuan_dense"]
PROMPT_LEN, NUM_DECODED = 40, 60
ATOL = {torch.float32: 2e-4, torch.bfloat16: None}  # bf16: judged by the greedy tokens only


@pytest.fixture(scope="module")
def hf_models(tiny_window_dirs):
    from transformers import AutoModelForCausalLM

    return {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            for name, path in tiny_window_dirs.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES + LAYER_NORM_FAMILIES + LAYER_BY_LAYER_FAMILIES)
def test_logits_at_every_position_past_the_window_match_transformers(
        family, dtype, tiny_window_dirs, hf_models):
    theirs = hf_models[family]
    ours = load_model(tiny_window_dirs[family], dtype, "cpu", select_backend("cpu"))
    prompt = random_prompt(ours.vocab_size, PROMPT_LEN)
    logits, tokens, tops = greedy_with_logits(ours, prompt, NUM_DECODED,
                                              block_size=8 if family == "phi3" else 4)
    check_logprobs_close([(tokens, tops)], [hf_continuation(theirs, prompt, NUM_DECODED)])
    if ATOL[dtype] is not None:
        with torch.inference_mode():  # one forward over the whole sequence: every position
            expected = theirs(torch.tensor([prompt + tokens[:-1]])).logits[0]
        torch.testing.assert_close(logits, expected, atol=ATOL[dtype], rtol=0)


@pytest.mark.skipif(cpu_linear._kernel() is None,
                    reason="the fp32 panel GEMM needs AVX-512 or AVX2 and FMA, and a C++ compiler")
def test_each_family_takes_the_one_call_decode_step(tiny_window_dirs):
    """A decode step of every family goes through the backend's one-call step (the layer
    descriptions carry windows, four norms, soft-capping, two RoPE tables, LayerNorms,
    parallel branches, ungated MLPs)."""
    for family in FAMILIES + LAYER_NORM_FAMILIES:
        ours = load_model(tiny_window_dirs[family], torch.float32, "cpu", select_backend("cpu"))
        assert ours.decode_step is not None, family
        greedy_with_logits(ours, random_prompt(ours.vocab_size, PROMPT_LEN), 4, block_size=4)
        assert ours.decode_step.num_steps == 3, family


def test_layers_are_grouped_by_their_window(tiny_window_dirs):
    groups = {family: [(g.window, g.layers) for g in load_model(
        tiny_window_dirs[family], torch.float32, "cpu", select_backend("cpu")).kv_cache_groups]
        for family in FAMILIES}
    assert groups["gemma3"] == [(None, (5,))] + [(WINDOW, (i,)) for i in range(5)]
    assert groups["gemma2"] == [(None, (1, 3)), (WINDOW, (0, 2))]
    assert groups["mistral"] == [(WINDOW, (0, 1))]
    assert groups["qwen2_window"] == [(None, (0, 1)), (WINDOW, (2, 3))]
    assert groups["phi3"] == [(None, (0, 1))]
    assert groups["smollm3"] == [(None, (0,)), (None, (1,)), (None, (2,)), (WINDOW, (3,))]
    assert groups["granite"] == groups["olmo2"] == [(None, (0, 1))]
    assert groups["olmo3"] == groups["exaone4"] == \
        [(None, (3,))] + [(WINDOW, (i,)) for i in range(3)]
    assert groups["ministral"] == [(None, (1,)), (WINDOW, (0,)), (WINDOW, (2,))]
    assert groups["gemma"] == groups["ministral3"] == groups["glm"] == groups["glm4"] == groups["phi3_partial"] == \
        groups["phi3_longrope"] == groups["ernie4_5"] == groups["helium"] == \
        groups["seed_oss"] == [(None, (0, 1))]


@pytest.mark.parametrize("kind", TEXT_TOWERS)
def test_a_checkpoint_with_a_vision_tower_is_served_as_its_text_tower(
        tiny_window_dirs, tmp_path, kind):
    """A multimodal checkpoint (Gemma 3, Mistral 3, LLaVA, Qwen2.5-VL, Qwen3-VL): its text
    decoder's logits, as transformers' whole model read from the same directory computes
    them for a prompt with no image (Qwen's multimodal RoPE by three equal positions; LM heads
    tied as transformers ties them: by the outer config's flag, unless the checkpoint has an
    LM head of its own, as Mistral Small 3's has under a config without the flag)."""
    model_class = save_multimodal(kind, tiny_window_dirs[TEXT_TOWERS[kind]], tmp_path)
    if kind == "mistral3_own_head":  # the flag left out: Mistral3Config's default ties
        saved = json.loads((tmp_path / "config.json").read_text())
        del saved["tie_word_embeddings"]
        (tmp_path / "config.json").write_text(json.dumps(saved))
        assert model_class.config_class.from_pretrained(tmp_path).tie_word_embeddings
    theirs = model_class.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = load_model(tmp_path, torch.float32, "cpu", select_backend("cpu"))
    prompt = random_prompt(ours.vocab_size, PROMPT_LEN)
    logits, tokens, _ = greedy_with_logits(ours, prompt, 24, block_size=4)
    with torch.inference_mode():
        expected = theirs(input_ids=torch.tensor([prompt + tokens[:-1]])).logits[0]
    torch.testing.assert_close(logits, expected, atol=ATOL[torch.float32], rtol=0)


def test_a_model_is_served_within_the_context_its_computed_math_holds(tiny_window_dirs):
    """Ministral 3's queries are scaled past its original context (Llama 4's attention
    temperature), which is not implemented: the context is capped there, and a longer
    --max-model-len is refused naming why. LongRoPE's whole context is served."""
    from checkpoints import MINISTRAL3_CONTEXT

    from actorlm.config import EngineConfig
    from actorlm.models.loader import load_hf_config

    hf_config = load_hf_config(tiny_window_dirs["ministral3"])
    assert hf_config.max_position_embeddings > MINISTRAL3_CONTEXT
    assert EngineConfig().resolve_lengths(hf_config).max_model_len == MINISTRAL3_CONTEXT
    with pytest.raises(ValueError, match=f"original_max_position_embeddings "
                                         f".{MINISTRAL3_CONTEXT}.*llama_4_scaling_beta"):
        EngineConfig(max_model_len=MINISTRAL3_CONTEXT + 1).resolve_lengths(hf_config)
    longrope = load_hf_config(tiny_window_dirs["phi3_longrope"])
    assert EngineConfig().resolve_lengths(longrope).max_model_len == \
        longrope.max_position_embeddings


@pytest.mark.parametrize("prompt_len", [LONGROPE_CONTEXT + 22, LONGROPE_CONTEXT - 8],
                         ids=["prompt_past_it", "decoding_past_it"])
def test_longrope_past_its_original_context_matches_transformers(tiny_window_dirs, hf_models,
                                                                 prompt_len):
    """transformers turns a sequence by LongRoPE's long factors once it reaches past the
    original context (128 positions here): a longer prompt by them at every position, a
    shorter one by its short factors until its decoding passes 128, its later positions by
    the long ones. The logits of each greedy step against transformers' own decoding with its
    KV cache, and with a longer prompt at every position against one forward over it all."""
    theirs = hf_models["phi3_longrope"]
    ours = load_model(tiny_window_dirs["phi3_longrope"], torch.float32, "cpu",
                      select_backend("cpu"))
    prompt = random_prompt(ours.vocab_size, prompt_len)
    logits, tokens, tops = greedy_with_logits(ours, prompt, 24, block_size=8)
    with torch.inference_mode():
        out = theirs(torch.tensor([prompt]), use_cache=True)
        expected = [out.logits[0, -1]]
        for token in tokens[:-1]:
            out = theirs(torch.tensor([[token]]), past_key_values=out.past_key_values,
                         use_cache=True)
            expected.append(out.logits[0, -1])
    torch.testing.assert_close(logits[prompt_len - 1:], torch.stack(expected), atol=2e-4, rtol=0)
    if prompt_len > LONGROPE_CONTEXT:
        with torch.inference_mode():
            whole = theirs(torch.tensor([prompt + tokens[:-1]])).logits[0]
        torch.testing.assert_close(logits, whole, atol=2e-4, rtol=0)
    # the short factors alone would not have given these
    assert not torch.allclose(theirs.model.rotary_emb.original_inv_freq,
                              theirs.model.rotary_emb.long_inv_freq)


@pytest.mark.parametrize("family", HEAD_NORM_FAMILIES)
def test_a_layer_norm_of_each_heads_q_and_k_decodes_layer_by_layer(tiny_window_dirs, family):
    """Command R+'s, StableLM 2 12B's and some Phi-2 fine-tunes' LayerNorm of each head's q and
    k (its weights each head's own: loaded as the projection's rows, reordered with them for
    RoPE on part of a head) runs in the model before the attention kernel; the one-call
    decode step, which has no such norm, declines the model rather than skip them."""
    from actorlm.models.layers import HeadLayerNorm

    ours = load_model(tiny_window_dirs[family], torch.float32, "cpu", select_backend("cpu"))
    attention = ours.model.layers[0].self_attn
    assert isinstance(attention.q_norm, HeadLayerNorm) and ours.decode_step is None
    heads = attention.q_norm.weight.view(attention.num_heads, -1)
    assert not torch.equal(heads[0], heads[1]) or family == "phi_qk_norm"  # (Phi's: one norm)


def test_hunyuans_norms_follow_rope_by_a_stretched_base(tiny_window_dirs):
    """Hunyuan turns q and k, then norms each head (the one-call step, which norms first,
    declines it), by the base its NTK alpha stretches (its config says "dynamic", yet the
    base is fixed: every position is served alike, up to max_position_embeddings)."""
    from actorlm.config import positions_served
    from actorlm.models.families import rope_inv_freq
    from actorlm.models.loader import load_hf_config

    config = load_hf_config(tiny_window_dirs["hunyuan_dense"])
    inv_freq, _ = rope_inv_freq(config)
    assert inv_freq[1].item() == pytest.approx((10000.0 * 1000.0 ** (16 / 14)) ** (-2 / 16))
    assert positions_served(config)[0] == config.max_position_embeddings
    ours = load_model(tiny_window_dirs["hunyuan_dense"], torch.float32, "cpu",
                      select_backend("cpu"))
    assert ours.model.layers[0].self_attn.norms_after_rope and ours.decode_step is None


@pytest.mark.parametrize("family, changes, said", [
    ("opt", {"do_layer_norm_before": False}, "do_layer_norm_before=False"),  # OPT-350m's
    ("opt", {"word_embed_proj_dim": 32}, "word_embed_proj_dim=32"),  # post-norm, embeddings
    ("opt", {"activation_function": "gelu"}, "activation 'gelu'"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ("gpt2", {"add_cross_attention": True}, "add_cross_attention=True"),
    ("falcon", {"alibi": True}, "alibi=True"),  # Falcon-RW's
    ("gpt_neox", {"hidden_act": "relu"}, "activation 'relu'")])
def test_what_these_families_compute_otherwise_is_refused_by_name(tiny_window_dirs, family,
                                                                  changes, said):
    from actorlm.models.families import check_config
    from actorlm.models.loader import load_hf_config

    config = load_hf_config(tiny_window_dirs[family])
    check_config(config)
    for name, value in changes.items():
        setattr(config, name, value)
    with pytest.raises(ValueError, match=f"{family}: {said}"):
        check_config(config)


def test_gpt2s_first_checkpoints_load_as_its_later_ones(tiny_window_dirs, tmp_path):
    """openai-community/gpt2's file names its tensors without ``transformer.`` and holds each
    layer's causal mask (``attn.bias``, ``attn.masked_bias``): the same model, to the bit."""
    import shutil

    from safetensors.torch import load_file, save_file

    source = tiny_window_dirs["gpt2"]
    shutil.copytree(source, tmp_path, dirs_exist_ok=True)
    state = load_file(source / "model.safetensors")
    old = {name.removeprefix("transformer."): tensor for name, tensor in state.items()}
    for layer in range(2):
        old[f"h.{layer}.attn.bias"] = torch.tril(torch.ones(1, 1, 512, 512))
        old[f"h.{layer}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(old, tmp_path / "model.safetensors")
    prompt = random_prompt(100, PROMPT_LEN)
    logits = [greedy_with_logits(load_model(path, torch.float32, "cpu", select_backend("cpu")),
                                 prompt, 4, block_size=4)[0] for path in (source, tmp_path)]
    assert torch.equal(*logits)
