"""Session fixtures: a tiny tokenizer, tiny random checkpoints of every family, SmolLM2.

The tiny checkpoints are real transformers models saved as Hugging Face directories, so every
test exercises the same loading path as a user's model and can compare against transformers.
Weights are drawn with a wide ``initializer_range`` so greedy continuations are peaky (no
near-ties that flip under float noise) without collapsing into one repeated token.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

__all__ = ["tiny_tokenizer_dir", "tiny_llama_dir", "tiny_llama_long_dir", "tiny_llama_draft_dir",
           "tiny_qwen2_dir",
           "tiny_qwen3_dir", "tiny_window_dirs", "tiny_moe_dirs", "smollm2_dir", "smollm2_gguf",
           "smollm2_dense_dir"]

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. Once upon a time there was a small village at the edge of a great forest, and
in that village lived an old baker who rose every morning before the sun to bake bread.
The people of the village loved his bread, and children would gather at his door to smell
the warm loaves. One winter the river froze, the roads closed, and no flour could reach the
village. The baker opened his last sack and shared it with every family until spring came.
Machine learning models read text as tokens. A tokenizer splits words into pieces that the
model has seen before, and the model predicts the next piece, one step at a time, until it
writes an answer. Questions and answers, numbers like 1, 2, 3, 42 and 2024, and punctuation
such as commas, periods, colons: all of them become tokens.
"""
_SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer (~400 tokens) with ChatML special tokens; eos is <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=_SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="<pad>",
        unk_token=None,
        chat_template=_CHAT_TEMPLATE,
    )
    path = tmp_path_factory.mktemp("tiny_tokenizer")
    fast.save_pretrained(path)
    return path


def _save_tiny(tmp_path_factory, tokenizer_dir, name, config, seed, **save_flags):
    """Random weights for ``config`` saved with the tokenizer beside them; returns the dir.
    ``save_flags`` go to ``save_pretrained``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    with torch.random.fork_rng(devices=[]):  # leave the session's global RNG alone
        torch.manual_seed(seed)
        model = perturbed(AutoModelForCausalLM.from_config(config, dtype=torch.float32))
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path, **save_flags)
    tokenizer.save_pretrained(path)
    return path


def perturbed(model):
    """``model`` with its biases and norm weights drawn at random: transformers initialises
    them to 0 and 1, where a mis-mapped bias or norm would not show in the logits. Nemotron's
    norm weights are centred on 0, as its checkpoints hold them (its LayerNorm1P adds the 1;
    transformers' 1 would double every normed activation)."""
    centre = 1.0 if model.config.model_type == "nemotron" else 0.0
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif name.endswith(".sinks"):  # (GPT-OSS's: a logit, comparable to the scores)
                param.normal_(0.0, 1.0)
            elif "norm" in name:
                param.add_(torch.randn_like(param) * 0.1 - centre)
        for name, buffer in model.named_buffers():  # (DeepSeek's routing bias, a buffer)
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.1)
    return model


# a multimodal checkpoint's kind -> the tiny text decoder of tiny_window_dirs inside it (Qwen's:
# Mistral's sizes alone)
TEXT_TOWERS = {"gemma3": "gemma3", "mistral3": "mistral", "mistral3_own_head": "mistral",
               "ministral3_vl": "ministral3", "llava": "helium", "qwen2_5_vl": "mistral",
               "qwen3_vl": "mistral"}
_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
          "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id")


def save_multimodal(kind: str, text_dir: pathlib.Path, out: pathlib.Path):
    """A tiny multimodal checkpoint of ``kind`` (``TEXT_TOWERS``) around the text decoder of
    ``text_dir``, random weights (perturbed) and a tiny vision tower, saved to ``out`` with
    the text decoder's tokenizer; returns the class transformers builds it with."""
    import transformers as tf

    text = json.loads((text_dir / "config.json").read_text())
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2)
    qwen_vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                       out_hidden_size=text["hidden_size"])
    # Qwen's multimodal RoPE: sections of the head's 8 frequencies by time, height, width
    mrope = {**{k: text[k] for k in _SIZES},
             "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [2, 3, 3]}}
    config, model_class = {
        "gemma3": lambda: (tf.Gemma3Config(
            text_config=text, vision_config={**vision, "image_size": 28, "patch_size": 14},
            mm_tokens_per_image=4, image_token_index=3),
            tf.Gemma3ForConditionalGeneration),
        # (Mistral 3's LM head tied by the outer config's default)
        "mistral3": lambda: (tf.Mistral3Config(text_config=text, vision_config={
            **vision, "head_dim": 16}), tf.Mistral3ForConditionalGeneration),
        # (Ministral 3's releases: a Mistral 3 around a ministral3 text decoder)
        "ministral3_vl": lambda: (tf.Mistral3Config(text_config=text, vision_config={
            **vision, "head_dim": 16}), tf.Mistral3ForConditionalGeneration),
        "mistral3_own_head": lambda: (tf.Mistral3Config(
            text_config=text, vision_config={**vision, "head_dim": 16},
            tie_word_embeddings=False), tf.Mistral3ForConditionalGeneration),
        "llava": lambda: (tf.LlavaConfig(text_config=text, vision_config={
            **vision, "model_type": "clip_vision_model", "image_size": 28, "patch_size": 14}),
            tf.LlavaForConditionalGeneration),
        "qwen2_5_vl": lambda: (tf.Qwen2_5_VLConfig(
            text_config=mrope, vision_config=qwen_vision, tie_word_embeddings=True),
            tf.Qwen2_5_VLForConditionalGeneration),
        "qwen3_vl": lambda: (tf.Qwen3VLConfig(
            text_config=mrope | {
                "rope_parameters": {**mrope["rope_parameters"], "mrope_interleaved": True}},
            vision_config={**qwen_vision, "deepstack_visual_indexes": [0]}),
            tf.Qwen3VLForConditionalGeneration),
    }[kind]()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        perturbed(model_class(config)).save_pretrained(out)
    tf.AutoTokenizer.from_pretrained(text_dir).save_pretrained(out)
    return model_class


def _common(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        initializer_range=0.3,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, tiny_tokenizer_dir):
    """Llama, 2 layers, hidden 64, 4 query / 2 KV heads, tied embeddings."""
    from transformers import LlamaConfig

    config = LlamaConfig(**_common(tiny_tokenizer_dir), tie_word_embeddings=True, rope_theta=10000.0)
    return _save_tiny(tmp_path_factory, tiny_tokenizer_dir, "tiny_llama", config, seed=0)


@pytest.fixture(scope="session")
def tiny_llama_long_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with an 8192-token context (RoPE needs no change): long prompts, and
    requests that certainly outlive a few seconds on any machine."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("tiny_llama_long") / "model"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 8192
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def tiny_llama_draft_dir(tiny_llama_dir, tmp_path_factory):
    """A draft for the tiny Llama: its weights with noise on the MLPs (5 % of each matrix's
    spread), so its greedy tokens agree with the Llama's often, not always: a draft model's
    proposals are accepted in part."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("tiny_llama_draft") / "model"
    shutil.copytree(tiny_llama_dir, path)
    weights = load_file(path / "model.safetensors")
    noise = torch.Generator().manual_seed(1)
    for name, tensor in weights.items():
        if ".mlp." in name:
            weights[name] = tensor + 0.05 * tensor.std() * torch.randn(tensor.shape,
                                                                       generator=noise)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, tiny_tokenizer_dir):
    """Qwen2 (qkv bias), untied lm_head."""
    from transformers import Qwen2Config

    config = Qwen2Config(**_common(tiny_tokenizer_dir), tie_word_embeddings=False, rope_theta=1000000.0)
    return _save_tiny(tmp_path_factory, tiny_tokenizer_dir, "tiny_qwen2", config, seed=1)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory, tiny_tokenizer_dir):
    """Qwen3 (per-head q/k RMSNorm), untied lm_head."""
    from transformers import Qwen3Config

    config = Qwen3Config(**_common(tiny_tokenizer_dir), tie_word_embeddings=False, rope_theta=1000000.0)
    return _save_tiny(tmp_path_factory, tiny_tokenizer_dir, "tiny_qwen3", config, seed=2)


WINDOW = 16  # the tiny sliding-window models' (not a multiple of every block size tried)
LONGROPE_CONTEXT = 128  # the tiny LongRoPE model's original context, of its 512 positions
MINISTRAL3_CONTEXT = 128  # the tiny Ministral 3's, past which its queries would be scaled
LONGROPE_FACTORS = {"short_factor": [1.0 + 0.3 * i for i in range(8)],
                    "long_factor": [4.0 + 0.5 * i for i in range(8)]}


@pytest.fixture(scope="session")
def tiny_window_dirs(tmp_path_factory, tiny_tokenizer_dir):
    """The families beyond Llama's, by name: Gemma (norms by 1 + weight, GeLU, the scaled
    embedding, a Llama's two norms a layer), Ministral (sliding layers by ``layer_types``),
    Ministral 3 (YaRN, Llama 4's attention temperature past 128 positions), StarCoder2
    (LayerNorm with biases, an ungated MLP, every layer sliding), Phi-2 (attention and an ungated
    MLP in parallel from one LayerNorm, RoPE on half of each head, a bias on the LM head), Cohere
    (attention and MLP in parallel from one LayerNorm without bias, RoPE on interleaved pairs,
    scaled logits), Cohere 2 (Cohere's, three sliding layers with RoPE to one full without),
    OPT (learned positions, no RoPE, an ungated ReLU MLP, biases everywhere), GPT-2 (OPT's
    layout with GeLU, its Conv1D weights stored transposed, q/k/v fused), StableLM (LayerNorms
    with biases, a gated SiLU MLP, RoPE on a quarter of each head, q/k/v biases; and with its
    branches in parallel from one norm), Nemotron (LayerNorms whose weights count from 1, an
    ungated MLP of ReLU squared, RoPE on half of each head, biases), Arcee (a Llama with that
    MLP), GPT-NeoX (q/k/v fused per head, exact GeLU, its branches in parallel each through
    its own norm; and in sequence), Falcon (``_falcons``), GPT-BigCode (GPT-2's layout with one
    KV head; and without, each head's q, k and v together),
    Gemma 3 (five sliding-window layers to one full,
    q/k norms, two RoPE bases), Gemma 2 (sliding and full in turn, soft-capped attention and
    logits), Mistral (every layer sliding), Qwen2 with ``use_sliding_window`` (its upper
    layers), Phi-3 (q/k/v and gate/up fused in the checkpoint), SmolLM3 (no RoPE in its
    fourth layer, which has the window), Granite (its four multipliers, none of them 1), OLMo 2
    (norms on the branches' outputs only, q/k norms over whole projections), OLMo (LayerNorms
    without weights, q/k/v clipped), OLMo 3 (OLMo 2's
    layers, three sliding to one full, each kind with its RoPE base), GLM and GLM-4 (RoPE on
    half of each head in interleaved pairs, q/k/v biases; GLM-4's four norms), Phi-3 with
    RoPE on three quarters of each head (Phi-4-mini's), Phi-3 with LongRoPE (Phi-3.5's: an
    original context of 128 positions of 512), ERNIE 4.5 (RoPE on interleaved pairs, a bias on
    every projection), EXAONE 4 (norms after the branches, per-head q/k norms, three sliding
    layers with RoPE to one full without), Helium (RoPE on interleaved pairs), Seed-OSS (q/k/v
    biases, none on o_proj)."""
    from transformers import (Ernie4_5Config, Exaone4Config, Gemma2Config, Gemma3TextConfig,
                              Cohere2Config, CohereConfig, GemmaConfig, Ministral3Config, MinistralConfig,
                              GPT2Config, OPTConfig, PhiConfig, Starcoder2Config,
                              Glm4Config, GlmConfig, GraniteConfig, HeliumConfig, MistralConfig,
                              Olmo2Config, Olmo3Config, Phi3Config, Qwen2Config, SeedOssConfig,
                              SmolLM3Config, StableLmConfig, NemotronConfig, ArceeConfig,
                              GPTNeoXConfig, OlmoConfig, GPTBigCodeConfig, HunYuanDenseV1Config)

    common = _common(tiny_tokenizer_dir)
    olmo = {k: v for k, v in common.items() if k != "head_dim"}  # (hidden / heads, always)
    gemma = dict(query_pre_attn_scalar=common["head_dim"], sliding_window=WINDOW,
                 tie_word_embeddings=True)
    configs = {
        "gemma3": Gemma3TextConfig(**{**common, "num_hidden_layers": 6}, **gemma),
        "gemma2": Gemma2Config(**{**common, "num_hidden_layers": 4}, **gemma,
                               attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
        "mistral": MistralConfig(**common, sliding_window=WINDOW, tie_word_embeddings=False),
        "qwen2_window": Qwen2Config(**{**common, "num_hidden_layers": 4}, use_sliding_window=True,
                                    sliding_window=WINDOW, max_window_layers=2,
                                    tie_word_embeddings=False),
        "phi3": Phi3Config(**common, tie_word_embeddings=False),
        "smollm3": SmolLM3Config(**{**common, "num_hidden_layers": 4}, use_sliding_window=True,
                                 sliding_window=WINDOW, rope_theta=10000.0),
        "granite": GraniteConfig(**common, tie_word_embeddings=True, embedding_multiplier=12.0,
                                 attention_multiplier=0.2, residual_multiplier=0.22,
                                 logits_scaling=8.0),
        "olmo": OlmoConfig(**olmo, clip_qkv=1.5, tie_word_embeddings=False),
        "olmo2": Olmo2Config(**olmo, tie_word_embeddings=False),
        "olmo3": Olmo3Config(**{**olmo, "num_hidden_layers": 4}, sliding_window=WINDOW,
                             rope_parameters={
                                 "sliding_attention": {"rope_type": "default",
                                                       "rope_theta": 10000.0},
                                 "full_attention": {"rope_type": "default",
                                                    "rope_theta": 1000000.0}}),
        "glm": GlmConfig(**common, attention_bias=True, tie_word_embeddings=False),
        "glm4": Glm4Config(**common, attention_bias=True, tie_word_embeddings=False),
        "phi3_partial": Phi3Config(**common, tie_word_embeddings=False,
                                   partial_rotary_factor=0.75),
        "phi3_longrope": Phi3Config(**common, tie_word_embeddings=False,
                                    original_max_position_embeddings=LONGROPE_CONTEXT,
                                    rope_scaling={"type": "longrope", **LONGROPE_FACTORS}),
        "ernie4_5": Ernie4_5Config(**common, use_bias=True, tie_word_embeddings=True),
        "exaone4": Exaone4Config(**{**common, "num_hidden_layers": 4}, sliding_window=WINDOW,
                                 sliding_window_pattern=4, tie_word_embeddings=False),
        "helium": HeliumConfig(**common, attention_bias=True, tie_word_embeddings=False),
        "seed_oss": SeedOssConfig(**common, attention_bias=True, attention_out_bias=False,
                                  tie_word_embeddings=False),
        "gemma": GemmaConfig(**common, tie_word_embeddings=True),
        "ministral": MinistralConfig(**{**common, "num_hidden_layers": 3}, sliding_window=WINDOW,
                                     layer_types=["sliding_attention", "full_attention",
                                                  "sliding_attention"],
                                     tie_word_embeddings=False),
        "ministral3": Ministral3Config(**common, tie_word_embeddings=False, rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": MINISTRAL3_CONTEXT, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "llama_4_scaling_beta": 0.1}),
        "starcoder2": Starcoder2Config(**common, sliding_window=WINDOW, use_bias=True,
                                       tie_word_embeddings=True),
        "phi": PhiConfig(**{k: v for k, v in common.items() if k != "head_dim"},
                         tie_word_embeddings=False),
        "cohere": CohereConfig(**common, logit_scale=0.25, attention_bias=True,
                               tie_word_embeddings=True),
        "cohere2": Cohere2Config(**{**common, "num_hidden_layers": 4}, sliding_window=WINDOW,
                                 logit_scale=0.5, tie_word_embeddings=True),
        "opt": OPTConfig(**{k: common[k] for k in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")},
            ffn_dim=common["intermediate_size"], word_embed_proj_dim=common["hidden_size"],
            init_std=common["initializer_range"], tie_word_embeddings=True),
        "stablelm": StableLmConfig(**common, use_qkv_bias=True, tie_word_embeddings=False),
        # each head's q and k through a LayerNorm of its own (StableLM 2 12B's, Command R+'s),
        # or all through one with a bias (Phi's qk_layernorm)
        # Hunyuan's q/k norms after RoPE, its NTK-alpha base
        "hunyuan_dense": HunYuanDenseV1Config(**common, tie_word_embeddings=True, rope_parameters={
            "rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "rope_theta": 10000.0}),
        "stablelm_qk_norm": StableLmConfig(**common, qk_layernorm=True, tie_word_embeddings=False),
        "cohere_qk_norm": CohereConfig(**common, logit_scale=0.25, use_qk_norm=True,
                                       tie_word_embeddings=True),
        "phi_qk_norm": PhiConfig(**{k: v for k, v in common.items() if k != "head_dim"},
                                 qk_layernorm=True, tie_word_embeddings=False),
        "stablelm_parallel": StableLmConfig(**common, use_parallel_residual=True,
                                            tie_word_embeddings=False),
        "nemotron": NemotronConfig(**common, attention_bias=True, mlp_bias=True,
                                   tie_word_embeddings=False),
        "arcee": ArceeConfig(**common, tie_word_embeddings=False),
        "gpt_neox": GPTNeoXConfig(**{k: v for k, v in common.items()
                                     if k not in ("head_dim", "num_key_value_heads")},
                                  tie_word_embeddings=False),
        "gpt_neox_sequential": GPTNeoXConfig(**{k: v for k, v in common.items()
                                                if k not in ("head_dim", "num_key_value_heads")},
                                             use_parallel_residual=False,
                                             tie_word_embeddings=False),
        **_falcons(common),
        **{name: GPTBigCodeConfig(**{k: common[k] for k in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
            "initializer_range")}, n_inner=common["intermediate_size"], multi_query=mq)
           for name, mq in (("gpt_bigcode", True), ("gpt_bigcode_mha", False))},
        "gpt2": GPT2Config(**{k: common[k] for k in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
            "initializer_range")}, n_inner=common["intermediate_size"]),
    }
    return {name: _save_tiny(tmp_path_factory, tiny_tokenizer_dir, f"tiny_{name}", config,
                             seed=10 + i)
            for i, (name, config) in enumerate(configs.items())}


def _falcons(common: dict) -> dict:
    """Falcon's three layouts: 7B's (one KV head, attention and MLP in parallel from one
    norm), the new decoder architecture's (KV groups, each branch through its own norm,
    biases) and the first one's without multi-query (each head's q, k and v together, the
    branches in sequence)."""
    from transformers import FalconConfig

    falcon = dict({k: common[k] for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
        "initializer_range")}, ffn_hidden_size=common["intermediate_size"])
    return {"falcon": FalconConfig(**falcon, multi_query=True, parallel_attn=True,
                                   tie_word_embeddings=True),
            "falcon_new": FalconConfig(**falcon, new_decoder_architecture=True, num_kv_heads=2,
                                       bias=True, tie_word_embeddings=False),
            "falcon_sequential": FalconConfig(**falcon, multi_query=False, parallel_attn=False,
                                              bias=True, tie_word_embeddings=False)}


@pytest.fixture(scope="session")
def tiny_moe_dirs(tmp_path_factory, tiny_tokenizer_dir):
    """The mixture-of-experts families by name, 8 experts each: Qwen3-MoE (top 2 renormalised;
    its middle layer dense by ``mlp_only_layers``), Qwen2-MoE (top 2 as the softmax gives them;
    a gated shared expert; layers 1 and 3 routed by ``decoder_sparse_step``, 0 and 2 dense and
    sliding), Mixtral (top 2 renormalised), OLMoE (q/k norms over whole projections, one KV
    head, q/k/v clipped), Granite MoE (Granite's four multipliers, its experts stacked in the
    checkpoint as Granite's releases store them), its shared variant (an unscaled shared MLP
    beside the experts), GLM-4.5 (DeepSeek's sigmoid routing by groups, renormalised and
    scaled, and without either), ERNIE 4.5 (the softmax plus a bias), Hunyuan (a router in
    fp32, q/k norms after RoPE), GPT-OSS (a biased router and experts, their clamped SwiGLU,
    attention sinks, sliding layers between full ones, YaRN), and ``qwen3_moe_stacked``,
    ``granitemoe_stacked``: the same weights saved as transformers holds them
    (``save_original_format=False``: the experts stacked under its own names)."""
    from transformers import (Ernie4_5_MoeConfig, Glm4MoeConfig, GptOssConfig, GraniteMoeConfig,
                              GraniteMoeSharedConfig, HunYuanMoEV1Config, MixtralConfig,
                              OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig)

    common = _common(tiny_tokenizer_dir)
    experts = dict(num_experts_per_tok=2, router_aux_loss_coef=0.0)
    configs = {
        "qwen3_moe": Qwen3MoeConfig(**{**common, "num_hidden_layers": 3}, **experts,
                                    num_experts=8, moe_intermediate_size=32,
                                    norm_topk_prob=True, mlp_only_layers=[1],
                                    tie_word_embeddings=False),
        "qwen2_moe": Qwen2MoeConfig(**{**common, "num_hidden_layers": 4}, **experts,
                                    num_experts=8, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=48, decoder_sparse_step=2,
                                    norm_topk_prob=False, use_sliding_window=True,
                                    sliding_window=WINDOW, max_window_layers=4,
                                    tie_word_embeddings=False),
        "mixtral": MixtralConfig(**{**common, "intermediate_size": 32}, **experts,
                                 num_local_experts=8, tie_word_embeddings=False),
        "olmoe": OlmoeConfig(**{**{k: v for k, v in common.items() if k != "head_dim"},
                                "intermediate_size": 32, "num_key_value_heads": 1}, **experts,
                             num_experts=8, clip_qkv=4.0, tie_word_embeddings=False),
        "granitemoe": GraniteMoeConfig(**{**common, "intermediate_size": 32}, **experts,
                                       num_local_experts=8, embedding_multiplier=12.0,
                                       attention_multiplier=0.2, residual_multiplier=0.22,
                                       logits_scaling=8.0, tie_word_embeddings=True),
        "granitemoeshared": GraniteMoeSharedConfig(
            **{**common, "intermediate_size": 32}, **experts, num_local_experts=8,
            shared_intermediate_size=48, embedding_multiplier=12.0, attention_multiplier=0.2,
            residual_multiplier=0.22, logits_scaling=8.0, tie_word_embeddings=True),
        # DeepSeek's routing: sigmoid scores and a bias, two groups of which one is chosen,
        # renormalised and scaled (or neither), a dense first layer, a shared MLP, q/k norms
        # and RoPE on half of each head
        "glm4_moe": Glm4MoeConfig(**{**common, "num_hidden_layers": 3}, **experts,
                                  n_routed_experts=8, n_shared_experts=1,
                                  moe_intermediate_size=32, n_group=2, topk_group=1,
                                  first_k_dense_replace=1, routed_scaling_factor=2.5,
                                  norm_topk_prob=True, use_qk_norm=True, attention_bias=True,
                                  tie_word_embeddings=False),
        # ERNIE's: the softmax plus a bias, renormalised; its first layer dense, a shared MLP,
        # RoPE on interleaved pairs
        "ernie4_5_moe": Ernie4_5_MoeConfig(**{**common, "num_hidden_layers": 3}, moe_k=2,
                                           moe_num_experts=8, moe_intermediate_size=32,
                                           moe_num_shared_experts=1, moe_layer_start_index=1,
                                           tie_word_embeddings=False),
        "glm4_moe_unnormed": Glm4MoeConfig(**common, **experts, n_routed_experts=8,
                                           n_shared_experts=2, moe_intermediate_size=32,
                                           first_k_dense_replace=0, routed_scaling_factor=1.5,
                                           norm_topk_prob=False, tie_word_embeddings=True),
        # Hunyuan-A13B's: every layer routed beside a shared MLP, the router in fp32, q/k
        # norms after RoPE, NTK-alpha RoPE
        "hunyuan_moe": HunYuanMoEV1Config(**{**common, "intermediate_size": 32}, num_experts=8,
                                          moe_topk=2, tie_word_embeddings=True,
                                          rope_parameters={"rope_type": "dynamic",
                                                           "alpha": 1000.0, "factor": 1.0,
                                                           "rope_theta": 10000.0}),
        # GPT-OSS's: sinks, a window on every other layer, YaRN (its release's but the
        # original context a quarter of the tiny model's)
        "gpt_oss": GptOssConfig(**{**common, "intermediate_size": 32}, num_local_experts=8,
                                num_experts_per_tok=2, sliding_window=WINDOW,
                                tie_word_embeddings=False,
                                rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                 "beta_fast": 32.0, "beta_slow": 1.0,
                                                 "truncate": False, "rope_theta": 150000.0,
                                                 "original_max_position_embeddings": 128}),
    }
    dirs = {name: _save_tiny(tmp_path_factory, tiny_tokenizer_dir, f"tiny_{name}", config,
                             seed=20 + i)
            for i, (name, config) in enumerate(configs.items())}
    for name in ("qwen3_moe", "granitemoe"):
        dirs[f"{name}_stacked"] = _save_tiny(tmp_path_factory, tiny_tokenizer_dir,
                                             f"tiny_{name}_stacked", configs[name],
                                             seed=20 + list(configs).index(name),
                                             save_original_format=False)
    return dirs


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded default model's cached directory (config and tokenizer; its weights stay
    in the GGUF file, in their blocks)."""
    from actorlm.models.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The embedded default model's GGUF file (Q4_1, its embedding Q8_0)."""
    from actorlm.models.loader import default_gguf_path

    return default_gguf_path()


@pytest.fixture(scope="session")
def smollm2_dense_dir(tmp_path_factory, smollm2_gguf):
    """The same weights dequantized by transformers (fp32 safetensors): the oracle's model, and
    the engine's dense twin."""
    from actorlm.models.gguf_file import write_dense_copy

    path = tmp_path_factory.mktemp("smollm2_dense")
    write_dense_copy(smollm2_gguf, path)
    return path
