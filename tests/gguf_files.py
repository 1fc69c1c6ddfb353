"""Tiny GGUF files written with the ``gguf`` package's writer, as llama.cpp's converter lays
them out: a tiny Hugging Face checkpoint's weights in one block format (q and k rows permuted
for a Llama), its tokenizer as GGUF metadata. transformers reads them back (dequantized) as the
oracle.

The 32-value formats are quantized from the checkpoint's weights with ``gguf.quants.quantize``;
the K formats, which gguf cannot quantize, get random valid blocks (every quant value drawn,
small scales) whose dequantized values become the weights.
"""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np
import torch

# GGUF name of each Hugging Face tensor (after "model.layers.N." / the top-level names)
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}
# Phi-3's fused q/k/v and gate/up
_PHI3_FUSED = {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
# OLMo 2's norms after attention and MLP (it has none before them)
_OUTPUT_NORMS = {"post_attention_layernorm": "post_attention_norm",
                 "post_feedforward_layernorm": "post_ffw_norm"}
# GLM-4's norms after attention and MLP, and its fused gate/up
_GLM4 = {"post_self_attn_layernorm": "post_attention_norm", "post_mlp_layernorm": "post_ffw_norm",
         "mlp.gate_up_proj": "ffn_up"}
# StarCoder2's and Phi-2's MLPs without a gate, Phi-2's attention output and last norm
_STARCODER2 = {"mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
_PHI2 = {"self_attn.dense": "attn_output", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
         "self_attn.qkv_proj": "attn_qkv"}
# GPT-NeoX's and Falcon's (under their own prefixes)
_GPTNEOX = {"attention.query_key_value": "attn_qkv", "attention.dense": "attn_output",
            "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down"}
_FALCON = {"self_attention.query_key_value": "attn_qkv", "self_attention.dense": "attn_output",
           "mlp.dense_h_to_4h": "ffn_up", "mlp.dense_4h_to_h": "ffn_down",
           "ln_attn": "attn_norm", "ln_mlp": "attn_norm_2"}
# GPT-2's and GPT-BigCode's (its Conv1D weights, [in, out], written as a Linear's)
_GPT2 = {"ln_1": "attn_norm", "ln_2": "ffn_norm", "attn.c_attn": "attn_qkv",
         "attn.c_proj": "attn_output", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
_GPT2_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight",
                ".mlp.c_proj.weight")
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
        "model.final_layernorm": "output_norm", "gpt_neox.embed_in": "token_embd",
        "gpt_neox.final_layer_norm": "output_norm", "embed_out": "output",
        "transformer.word_embeddings": "token_embd", "transformer.ln_f": "output_norm",
        "transformer.wte": "token_embd", "transformer.wpe": "position_embd"}
# llama.cpp's name of a Hugging Face model_type where the two differ
_ARCHITECTURES = {"olmo3": "olmo2", "phi": "phi2", "cohere": "command-r", "gpt_neox": "gptneox",
                  "gpt_bigcode": "starcoder"}
K_TYPES = ("Q4_K", "Q5_K", "Q6_K")
# q and k rows permuted by llama.cpp's converter
PERMUTED = ("llama", "smollm3", "granite", "olmo")
GEMMA = ("gemma", "gemma2", "gemma3", "nemotron")  # norms stored as 1 + weight
# a Granite config's multipliers -> the metadata keys llama.cpp's converter writes them under
_GRANITE_SCALES = {"embedding_multiplier": "add_embedding_scale",
                   "attention_multiplier": "add_attention_scale",
                   "residual_multiplier": "add_residual_scale", "logits_scaling": "add_logit_scale"}


def gguf_name(hf_name: str, arch: str) -> str:
    stem, _, kind = hf_name.rpartition(".")
    if stem.startswith(("model.layers.", "gpt_neox.layers.", "transformer.h.")):
        _, _, layer, part = stem.split(".", 3)
        names = {"olmo2": {**_LAYER, **_OUTPUT_NORMS}, "exaone4": {**_LAYER, **_OUTPUT_NORMS},
                 "phi3": {**_LAYER, **_PHI3_FUSED},
                 "seed_oss": {**_LAYER, "post_attention_layernorm": "post_attention_norm"},
                 "glm4": {**_LAYER, **_GLM4}, "starcoder2": {**_LAYER, **_STARCODER2},
                 "phi2": {**_LAYER, **_PHI2}, "gptneox": {**_LAYER, **_GPTNEOX},
                 "falcon": {**_LAYER, **_FALCON}, "gpt2": _GPT2, "starcoder": _GPT2}.get(arch,
                                                                                      _LAYER)
        return f"blk.{layer}.{names[part]}.{kind}"
    return f"{_TOP[stem]}.{kind}"


def random_blocks(type_name: str, rows: int, columns: int, seed: int) -> np.ndarray:
    """Valid random blocks of a K format: random quant bits and sub-block scales, the f16
    super-scales 0.3 / (largest sub-block scale x largest quant), so that values stay within
    about +-0.3, as a tiny model's do; [rows, bytes per row] uint8."""
    import gguf

    kind = gguf.GGMLQuantizationType[type_name]
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * columns // per_block, block_bytes), dtype=np.uint8)
    scale = np.float16(0.3 / {"Q4_K": 63 * 15, "Q5_K": 63 * 31, "Q6_K": 128 * 32}[type_name])
    scales = np.full(len(blocks), scale, dtype=np.float16).view(np.uint8).reshape(-1, 2)
    if type_name == "Q6_K":  # d is the block's last two bytes; its int8 scales stay random
        blocks[:, -2:] = scales
    else:  # d, dmin first
        blocks[:, 0:2] = scales
        blocks[:, 2:4] = scales
    return blocks.reshape(rows, -1)


def write_gguf(hf_dir: pathlib.Path, out: pathlib.Path, type_name: str,
               eot_token_id: int | None = None, pooling_type=None,
               fuse_qkv: bool = False, architecture: str | None = None) -> pathlib.Path:
    """The checkpoint ``hf_dir`` (Llama, SmolLM3, Granite, OLMo 2, Phi-3, EXAONE 4, GLM-4,
    ERNIE 4.5, Seed-OSS, Gemma, Qwen2, Qwen3, StarCoder2, Phi-2, Cohere, Cohere 2, StableLM,
    Nemotron, Arcee, OLMo, GPT-NeoX, Falcon, GPT-2 or GPT-BigCode) as a GGUF file whose matrices are all ``type_name`` blocks (norms and
    biases F32), with an end-of-turn token where given, an embedding model's
    ``gguf.PoolingType`` where given (as llama.cpp's converter writes a sentence-transformers
    model's), q/k/v fused into one tensor where asked (as the files of Phi-2's first
    checkpoint have them), under ``architecture`` where given (a Qwen2 or Qwen3 written as the
    text decoder of a Qwen2-VL or Qwen3-VL file, with the multimodal RoPE's sections); returns
    the file."""
    import gguf
    from safetensors.torch import load_file

    config = _gpt2_sizes(json.loads((hf_dir / "config.json").read_text()))
    arch = architecture or _ARCHITECTURES.get(config["model_type"], config["model_type"])
    state = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(file))
    state = _stacked_head_norms({name: tensor for name, tensor in state.items()
                                 if not name.endswith((".attn.bias", ".attn.masked_bias"))})
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    if fuse_qkv:
        state = _fused_qkv(state)
    writer = gguf.GGUFWriter(out, arch)
    _write_config(writer, config)
    if arch == "phi3":
        _write_phi3_rope(writer, config)
    if config.get("sliding_window") and arch in ("exaone4", "olmo2"):
        writer.add_sliding_window(config["sliding_window"])
        writer.add_sliding_window_pattern([t == "sliding_attention"
                                           for t in config["layer_types"]])
    if arch == "cohere2":  # (its window alone: llama.cpp's loader fixes the pattern)
        writer.add_sliding_window(config["sliding_window"])
    if "logit_scale" in config:
        writer.add_logit_scale(config["logit_scale"])
    if config["model_type"] == "olmo" and config.get("clip_qkv") is not None:
        writer.add_clamp_kqv(config["clip_qkv"])
    if arch == "gptneox":
        writer.add_parallel_residual(config["use_parallel_residual"])
    if arch in ("qwen2vl", "qwen3vl"):  # time, height, width and an unused fourth
        half = (config.get("head_dim") or
                config["hidden_size"] // config["num_attention_heads"]) // 2
        time, height = half // 4, (half - half // 4) // 2
        writer.add_rope_dimension_sections([time, height, half - time - height, 0])
    if config["model_type"] == "olmo3":
        _write_olmo3_rope(writer, config["rope_parameters"])
    if (config.get("rope_parameters") or {}).get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_divisors(config))
    _write_tokenizer(writer, hf_dir)
    if eot_token_id is not None:
        writer.add_eot_token_id(eot_token_id)
    if pooling_type is not None:
        writer.add_pooling_type(pooling_type)
    kind = gguf.GGMLQuantizationType[type_name]
    for seed, (name, tensor) in enumerate(sorted(state.items())):
        values = tensor.float().numpy()
        if ".query_key_value." in name:  # each group's q, k, v: regrouped, as the converters do
            values = _regrouped_qkv(values, config)
        if arch == "gpt2" and name.endswith(_GPT2_CONV1D):
            values = values.T.copy()
        if arch in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads"] if "q_proj" in name else \
                config["num_key_value_heads"]
            values = _permute(values, heads)
        if values.ndim == 1 or name.endswith("norm.weight"):  # (norms in F32, per head too)
            if arch in GEMMA and name.endswith("norm.weight"):  # (llama.cpp's converter)
                values = values + 1
            writer.add_tensor(gguf_name(name, arch), values)
        elif type_name in K_TYPES:
            writer.add_tensor(gguf_name(name, arch),
                              random_blocks(type_name, *values.shape, seed),
                              raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name(name, arch), gguf.quants.quantize(values, kind),
                              raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _stacked_head_norms(state: dict) -> dict:
    """StableLM's q/k LayerNorms of each head (``q_layernorm.norms.H``) as one [heads,
    head_dim] tensor, ``q_norm``, as llama.cpp's converter stacks them."""
    stacked, heads = {}, {}
    for name, tensor in state.items():
        stem, found, rest = name.partition("_layernorm.norms.")
        if not found:
            stacked[name] = tensor
            continue
        head, _, kind = rest.partition(".")
        heads.setdefault(f"{stem}_norm.{kind}", {})[int(head)] = tensor
    for name, parts in heads.items():
        stacked[name] = torch.stack([parts[h] for h in sorted(parts)])
    return stacked


def _gpt2_sizes(config: dict) -> dict:
    """A GPT-2 or GPT-BigCode config with the sizes under the names the others use."""
    if config["model_type"] not in ("gpt2", "gpt_bigcode"):
        return config
    heads = config["n_head"]
    return {**config, "num_hidden_layers": config["n_layer"],
            "max_position_embeddings": config["n_positions"], "hidden_size": config["n_embd"],
            "intermediate_size": config["n_inner"] or 4 * config["n_embd"],
            "num_attention_heads": heads,
            "num_key_value_heads": 1 if config.get("multi_query") else heads,
            "layer_norm_eps": config["layer_norm_epsilon"]}


def _regrouped_qkv(rows: np.ndarray, config: dict) -> np.ndarray:
    """GPT-NeoX's and Falcon's fused q/k/v rows, in groups of each group's queries, its key and
    its value, as every query, then every key, then every value (llama.cpp's converters')."""
    heads = config["num_attention_heads"]
    groups = heads if config["model_type"] == "gpt_neox" else \
        config["num_kv_heads"] if config["new_decoder_architecture"] else 1
    grouped = rows.reshape(groups, heads // groups + 2, -1, *rows.shape[1:])
    parts = (grouped[:, :-2], grouped[:, -2:-1], grouped[:, -1:])
    return np.concatenate([p.reshape(-1, *rows.shape[1:]) for p in parts])


def _fused_qkv(state: dict) -> dict:
    """Each layer's q/k/v weights and biases as one ``qkv_proj`` tensor, rows q, k, v."""
    fused = {}
    for name, tensor in state.items():
        if ".self_attn.q_proj." in name:
            parts = [state[name.replace(".q_proj.", f".{p}.")] for p in ("q_proj", "k_proj",
                                                                          "v_proj")]
            fused[name.replace(".q_proj.", ".qkv_proj.")] = torch.cat(parts)
        elif ".self_attn.k_proj." not in name and ".self_attn.v_proj." not in name:
            fused[name] = tensor
    return fused


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation: each head's two rotary halves interleaved."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]) \
        .swapaxes(1, 2).reshape(rows.shape)


def _write_config(writer, config: dict) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config.get("intermediate_size") or config["ffn_hidden_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config.get("num_key_value_heads") or config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = config.get("rope_parameters") or {}
    writer.add_rope_dimension_count(int(head_dim * (rope.get("partial_rotary_factor") or 1.0)))
    rope = rope.get("full_attention", rope)  # (OLMo 3's per kind of layer: the full layers')
    writer.add_rope_freq_base(config.get("rope_theta") or rope.get("rope_theta", 10000.0))
    if "rms_norm_eps" in config:
        writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    else:  # a LayerNorm family's
        writer.add_layer_norm_eps(config.get("layer_norm_eps") or config.get("norm_eps") or
                                  config.get("norm_epsilon") or 1e-5)  # (OLMo's: fixed)
    writer.add_vocab_size(config["vocab_size"])
    for multiplier, add in _GRANITE_SCALES.items():
        if multiplier in config:
            getattr(writer, add)(config[multiplier])


def _write_phi3_rope(writer, config: dict) -> None:
    """What llama.cpp's converter writes of a Phi-3's RoPE and window: the original context,
    the window (0: none) and LongRoPE's factors as two tensors, with its attention factor."""
    rope = config.get("rope_parameters") or {}
    original = rope.get("original_max_position_embeddings") or \
        config.get("original_max_position_embeddings") or config["max_position_embeddings"]
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(config.get("sliding_window") or 0)
    if rope.get("rope_type") == "longrope":
        scale = config["max_position_embeddings"] / original
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.array(rope[f"{kind}_factor"], dtype=np.float32))


def _write_olmo3_rope(writer, rope: dict) -> None:
    """OLMo 3's RoPE per kind of layer beside the full layers' base (``_write_config``), under
    the keys llama.cpp reads: the sliding layers' base, the full layers' YaRN."""
    import gguf

    full, sliding = rope["full_attention"], rope["sliding_attention"]
    writer.add_rope_freq_base_swa(sliding["rope_theta"])
    if full["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(full["factor"])
        writer.add_rope_scaling_attn_factors(full["attention_factor"])
        writer.add_rope_scaling_orig_ctx_len(full["original_max_position_embeddings"])


def _llama3_divisors(config: dict) -> np.ndarray:
    """Llama 3's RoPE scaling as llama.cpp's converter stores it: each frequency's divisor,
    1 for short wavelengths, the factor for long ones, a smooth blend between."""
    rope = config["rope_parameters"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    original = rope["original_max_position_embeddings"]
    long_wave, short_wave = original / rope["low_freq_factor"], original / rope["high_freq_factor"]
    divisors = []
    for i in range(0, dim, 2):
        wavelength = 2 * math.pi * rope["rope_theta"] ** (i / dim)
        if wavelength < short_wave:
            divisors.append(1.0)
        elif wavelength > long_wave:
            divisors.append(rope["factor"])
        else:
            smooth = (original / wavelength - rope["low_freq_factor"]) / \
                (rope["high_freq_factor"] - rope["low_freq_factor"])
            divisors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(divisors, dtype=np.float32)


def _write_tokenizer(writer, hf_dir: pathlib.Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    spec = json.loads((hf_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    special = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    tokens = [None] * len(tokenizer)
    for token, index in {**vocab, **special}.items():
        tokens[index] = token
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if token in special else 1 for token in tokens])
    merges = spec["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)


def dequantized_model(gguf_path: pathlib.Path):
    """transformers' model of the file, dequantized to fp32: the oracle."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                dtype=torch.float32,
                                                local_files_only=True).eval()


def dequantized_checkpoint(hf_dir: pathlib.Path, type_name: str, kept: tuple[str, ...] = ()):
    """transformers' model of the checkpoint ``hf_dir`` (fp32) with every matrix but norms and
    those whose names end in ``kept`` quantized to ``type_name`` and dequantized by gguf, as the
    GGUF writers here store them (gguf quantizes each row alone, so stacking and llama.cpp's
    row permutation change nothing): the oracle of a file transformers does not read."""
    import gguf
    from transformers import AutoModelForCausalLM

    kind = gguf.GGMLQuantizationType[type_name]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2 or name.endswith(("norm.weight", *kept)):  # (Cohere's per head)
                continue
            blocks = gguf.quants.quantize(param.numpy(), kind)
            param.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, kind)))
    return model
