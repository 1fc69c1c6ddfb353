"""Configs from a GGUF file's metadata, for the architectures transformers does not read.

transformers rebuilds the config of a Llama, Qwen2/3 or Gemma file itself; for the others the
config is built here from llama.cpp's keys (``gguf-py/gguf/constants.py`` names them): the
sizes every decoder has (``decoder_fields``), and what an architecture adds
(``gguf_moe`` for the mixtures of experts, ``smollm3_config``, ``granite_config``,
``olmo2_config``, ``phi3_config``, ``exaone4_config``, ``glm4_config``, ``ernie4_5_config``,
``seed_oss_config``, the LayerNorm families: ``starcoder2_config``, ``phi2_config``,
``command_r_config``, ``cohere2_config``, ``stablelm_config``, ``nemotron_config``,
``arcee_config``, ``olmo_config``, ``gptneox_config``, ``falcon_config``, ``gpt2_config``,
``starcoder_config``, and the multimodal
files' text decoders: ``qwen2vl_config``, ``qwen3vl_config``).

- ``smollm3``: a Llama (q and k rows permuted as a Llama's) that leaves RoPE out of every
  fourth layer. llama.cpp keeps no key for it (its graph skips RoPE where ``(layer + 1) % 4``
  is 0, as SmolLM3's config does by default, ``no_rope_layer_interval`` 4), and none for a
  sliding window (its graph has none).
- ``granite``: a Llama (q and k permuted too) with Granite's four multipliers, each stored
  only where it is not 1: ``embedding_scale``, ``attention.scale``, ``residual_scale`` and
  ``logit_scale`` (the logits' divisor, transformers' ``logits_scaling``).
- ``olmo2``: norms after the attention and the MLP only (``post_attention_norm``,
  ``post_ffw_norm``), q/k norms over whole projections; q and k are not permuted. OLMo 3's
  files say ``olmo2`` too, with a sliding window: read as OLMo 3 (``_olmo3_config``).
- ``phi3``: q/k/v and gate/up fused (``attn_qkv``, ``ffn_up``: the model splits them as a
  Phi-3 checkpoint's), not permuted. transformers reads its sizes but not what sets Phi-3.5
  and Phi-4-mini apart: RoPE on ``rope.dimension_count`` of each head's features, the
  sliding window (0: none), and LongRoPE, stored as two tensors of factors
  (``rope_factors_long``, ``rope_factors_short``) with ``rope.scaling.original_context_length``
  and its ``attn_factor``.
- ``glm4`` (GLM-4-0414), ``ernie4_5`` (ERNIE 4.5, dense) and ``seed_oss``: their
  checkpoints' tensors as they are (llama.cpp's converter permutes none's q and k: GLM-4 and
  ERNIE rotate interleaved pairs, which the model reorders as it does a checkpoint's;
  Seed-OSS halves, as llama.cpp's NEOX RoPE does); their biases told by the tensors (GLM-4's
  and Seed-OSS's on q/k/v, Seed-OSS's o by ``attention_out_bias``, ERNIE's ``use_bias`` on
  every projection). GLM-4 rotates ``rope.dimension_count`` of each head's features (half)
  and keeps gate/up fused (``ffn_up``); its four norms are ``attn_norm``,
  ``post_attention_norm`` (after attention), ``ffn_norm`` and ``post_ffw_norm``. Seed-OSS's
  norm before the MLP is ``post_attention_norm`` in the file.
- ``exaone4``: OLMo 2's norms (after attention and MLP only) with q/k norms per head, q and
  k not permuted; a sliding window on the layers ``attention.sliding_window_pattern`` marks,
  RoPE on those alone (on all where there is no window), as llama.cpp's graph and
  transformers' model do.
- ``starcoder2``, ``phi2``, ``command-r`` (Command R, Aya) and ``cohere2`` (Command R7B):
  LayerNorms (``attention.layer_norm_epsilon``), q and k as their checkpoints have them (Phi-2
  and StarCoder2 rotate halves, as llama.cpp's NEOX RoPE; Cohere interleaved pairs, as its
  NORM RoPE). StarCoder2's and Phi-2's MLPs have no gate (``ffn_up`` is ``c_fc`` / ``fc1``);
  Phi-2 rotates ``rope.dimension_count`` of each head's features and its q/k/v are fused
  (``attn_qkv``) in the files converted from its first checkpoint; Cohere's files keep the
  ``logit_scale`` the logits are multiplied by, and Command R7B's the window of its sliding
  layers (three to every full one, as llama.cpp's loader fixes it).
- ``stablelm``: LayerNorms with biases and a gated MLP, RoPE on ``rope.dimension_count`` of
  each head's features (halves, not permuted); the tensors tell the rest, as llama.cpp's graph
  reads them: q/k/v biases, no ``ffn_norm`` (the branches in parallel from one norm,
  ``use_parallel_residual``), per-head q/k norms (StableLM 2 12B's, stacked [heads, head_dim]).
  transformers reads these files, but takes neither the rotated share nor the branches from
  them.
- ``nemotron``: LayerNorms (``attention.layer_norm_epsilon``) whose weights the converter
  stored as 1 + weight (read back as the checkpoint's), an ungated MLP (``ffn_up``), RoPE on
  ``rope.dimension_count`` of each head's features; ``arcee``: a Llama (q and k not permuted)
  with that MLP. Their biases the tensors tell.
- ``olmo`` (OLMo 1): a Llama (q and k permuted as a Llama's) with no norm weights in the file
  (its LayerNorms learn none) and ``attention.clamp_kqv`` as ``clip_qkv``.
- ``gptneox`` (Pythia and its kin): LayerNorms, q/k/v fused as every head's q, then k, then v
  (the converter regroups the checkpoint's heads), an ungated MLP, RoPE on
  ``rope.dimension_count`` of each head's features, ``use_parallel_residual``. The file names
  no activation: the checkpoints' exact GeLU (GPT-NeoX-20B's tanh form differs in the last
  bits).
- ``falcon``: q/k/v as every query head, then the KV heads' keys, then their values (the
  converter regroups them), attention and MLP in parallel: from one norm (7B's), or each from
  its own (``attn_norm_2``: Falcon-40B's and -180B's new decoder architecture); one KV head
  (7B's) or ``head_count_kv`` groups; biases as the tensors tell.
- ``gpt2`` and ``starcoder`` (GPT-BigCode: StarCoder, SantaCoder): no RoPE but learned
  positions (``position_embd``), LayerNorms, q/k/v fused as q, then k, then v (the converter
  writes GPT-2's Conv1D weights transposed, as a Linear's), tanh GeLU, biases everywhere.
  ``starcoder`` files have one KV head (llama.cpp's converter writes no other: a checkpoint
  without multi-query keeps each head's q, k and v together, which its graph does not read, so
  such a file is refused).
- ``qwen2vl`` (Qwen2-VL, Qwen2.5-VL) and ``qwen3vl`` (Qwen3-VL): the text decoder of a
  multimodal file (its vision tower is a file apart, the mmproj), read as Qwen2 / Qwen3. Text
  tokens take one position in all of the multimodal RoPE's sections, which makes it the text
  model's RoPE.
- Llama 3.1-3.3 (and what took their RoPE scaling, EXAONE 4): the converter stores the ``llama3``
  scaling as a tensor of divisors of the frequencies, ``rope_freqs`` (``read_rope_freqs``).
"""

from __future__ import annotations

_REQUIRED = object()
# tensors that are config, not weights: LongRoPE's factors (``phi3_config`` reads them) and
# Llama 3's frequency divisors (``read_rope_freqs``)
CONFIG_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight")
# Llama 3's RoPE scaling (3.1 to 3.3, and the families that took it) but its factor
_LLAMA3 = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}


def field(reader, key: str, default=_REQUIRED):
    """A scalar (or string) of the file's metadata; ``default`` where it has none."""
    entry = reader.fields.get(key)
    if entry is None:
        if default is _REQUIRED:
            raise ValueError(f"the GGUF file has no {key!r}, which its architecture needs")
        return default
    return entry.contents()


def _refuse_rope_scaling(reader, arch: str) -> None:
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"GGUF {arch} file: rope scaling {scaling!r} is not implemented for "
                         f"this architecture")


def head_dim(reader, arch: str) -> int:
    return field(reader, f"{arch}.attention.key_length",
                 field(reader, f"{arch}.embedding_length") //
                 field(reader, f"{arch}.attention.head_count"))


def decoder_fields(reader, arch: str, tensor_names: list[str],
                   reads_rope_scaling: bool = False) -> dict:
    """The config fields of any decoder file (``tensor_names``: its tensors' Hugging Face
    names, which tell whether the LM head is tied); a RoPE scaling is refused unless the
    caller ``reads_rope_scaling`` itself. ``rms_norm_eps`` is a LayerNorm family's epsilon
    where the file has that one (its config builder renames it)."""
    if not reads_rope_scaling:
        _refuse_rope_scaling(reader, arch)
    heads = field(reader, f"{arch}.attention.head_count")
    return dict(
        vocab_size=field(reader, f"{arch}.vocab_size", None) or
        len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=field(reader, f"{arch}.embedding_length"),
        intermediate_size=field(reader, f"{arch}.feed_forward_length"),
        num_hidden_layers=field(reader, f"{arch}.block_count"), num_attention_heads=heads,
        num_key_value_heads=field(reader, f"{arch}.attention.head_count_kv", heads),
        max_position_embeddings=field(reader, f"{arch}.context_length"),
        rms_norm_eps=field(reader, f"{arch}.attention.layer_norm_rms_epsilon", None) or
        field(reader, f"{arch}.attention.layer_norm_epsilon"),
        rope_parameters={"rope_type": "default",
                         "rope_theta": field(reader, f"{arch}.rope.freq_base", 10000.0)},
        tie_word_embeddings="lm_head.weight" not in tensor_names,
        eos_token_id=end_tokens(reader),
        **{f"{token}_token_id": field(reader, f"tokenizer.ggml.{gguf_token}_token_id", None)
           for token, gguf_token in (("bos", "bos"), ("pad", "padding"))})


def end_tokens(reader) -> int | list[int] | None:
    """The tokens that end a generation, as llama.cpp's: the end of text, and the end of a
    turn or a message where the file names one apart (GLM-4's ``<|user|>``)."""
    ends = sorted({token for key in ("eos", "eot", "eom")
                   if (token := field(reader, f"tokenizer.ggml.{key}_token_id", None))
                   is not None})
    return ends[0] if len(ends) == 1 else ends or None


def smollm3_config(reader, tensor_names: list[str]):
    from transformers import SmolLM3Config

    return SmolLM3Config(**decoder_fields(reader, "smollm3", tensor_names),
                         head_dim=head_dim(reader, "smollm3"), **biases(tensor_names))


def gemma_config(reader, tensor_names: list[str]):
    """A Gemma (1) file: a Llama's fields; its activation (GeLU, tanh) and scalings are the
    architecture's, not the file's."""
    from transformers import GemmaConfig

    return GemmaConfig(**decoder_fields(reader, "gemma", tensor_names),
                       head_dim=head_dim(reader, "gemma"))


def granite_config(reader, tensor_names: list[str]):
    from transformers import GraniteConfig

    return GraniteConfig(**decoder_fields(reader, "granite", tensor_names), **biases(tensor_names),
                         **granite_multipliers(reader, "granite"))


def granite_multipliers(reader, arch: str) -> dict:
    """A Granite file's four scales, under its config's names (Granite MoE's too)."""
    return dict(embedding_multiplier=field(reader, f"{arch}.embedding_scale", 1.0),
                attention_multiplier=field(reader, f"{arch}.attention.scale", 1.0),
                residual_multiplier=field(reader, f"{arch}.residual_scale", 1.0),
                logits_scaling=field(reader, f"{arch}.logit_scale", 1.0))


def olmo2_config(reader, tensor_names: list[str]):
    from transformers import Olmo2Config

    window = field(reader, "olmo2.attention.sliding_window", 0) or None
    fields = decoder_fields(reader, "olmo2", tensor_names, reads_rope_scaling=window is not None)
    if head_dim(reader, "olmo2") * fields["num_attention_heads"] != fields["hidden_size"]:
        raise ValueError("olmo2: attention.key_length times the heads is not the embedding "
                         "length (its q norm has one weight per feature of q)")
    bias = biases(tensor_names)["attention_bias"]
    if window is None:
        return Olmo2Config(**fields, attention_bias=bias)
    return _olmo3_config(reader, fields, window, bias)


def _olmo3_config(reader, fields: dict, window: int, bias: bool):
    """OLMo 3, whose files say ``olmo2``: sliding layers by ``sliding_window_pattern`` (one
    flag a layer, or a period whose last layer is full); RoPE on them by ``freq_base_swa``
    (else ``freq_base``) without scaling, on the full layers by ``freq_base`` with the file's
    YaRN, as llama.cpp's graph and transformers' model both do."""
    from transformers import Olmo3Config

    theta = fields["rope_parameters"]["rope_theta"]
    full = {"rope_type": "default", "rope_theta": theta}
    scaling = field(reader, "olmo2.rope.scaling.type", "none")
    if scaling == "yarn":
        full.update(rope_type="yarn", factor=field(reader, "olmo2.rope.scaling.factor"),
                    original_max_position_embeddings=field(
                        reader, "olmo2.rope.scaling.original_context_length"))
        if (attention := field(reader, "olmo2.rope.scaling.attn_factor", None)) is not None:
            full["attention_factor"] = attention
    elif scaling != "none":
        raise ValueError(f"GGUF olmo2 file: rope scaling {scaling!r} is not implemented")
    rope = {"full_attention": full, "sliding_attention": {
        "rope_type": "default", "rope_theta": field(reader, "olmo2.rope.freq_base_swa", theta)}}
    return Olmo3Config(**{**fields, "rope_parameters": rope}, attention_bias=bias,
                       sliding_window=window,
                       layer_types=_layer_types(reader, "olmo2", fields, default_period=4))


def phi3_config(reader, tensor_names: list[str]):
    from transformers import Phi3Config

    fields = decoder_fields(reader, "phi3", tensor_names)
    rope = {**fields["rope_parameters"], "partial_rotary_factor": _rotated_share(reader, "phi3")}
    factors = {t.name: [float(x) for x in t.data] for t in reader.tensors
               if t.name in CONFIG_TENSORS}
    original = field(reader, "phi3.rope.scaling.original_context_length", None)
    if factors:
        rope.update(rope_type="longrope", long_factor=factors["rope_factors_long.weight"],
                    short_factor=factors["rope_factors_short.weight"],
                    original_max_position_embeddings=original,
                    attention_factor=field(reader, "phi3.rope.scaling.attn_factor", None))
    return Phi3Config(**{**fields, "rope_parameters": rope}, head_dim=head_dim(reader, "phi3"),
                      sliding_window=field(reader, "phi3.attention.sliding_window", 0) or None,
                      original_max_position_embeddings=original)


def glm4_config(reader, tensor_names: list[str]):
    from transformers import Glm4Config

    fields = decoder_fields(reader, "glm4", tensor_names)
    rope = {**fields["rope_parameters"], "partial_rotary_factor": _rotated_share(reader, "glm4")}
    return Glm4Config(**{**fields, "rope_parameters": rope}, head_dim=head_dim(reader, "glm4"),
                      attention_bias=_has(tensor_names, "q_proj.bias"))


def exaone4_config(reader, tensor_names: list[str]):
    from transformers import Exaone4Config

    fields = decoder_fields(reader, "exaone4", tensor_names)
    window = field(reader, "exaone4.attention.sliding_window", 0) or None
    types = _layer_types(reader, "exaone4", fields) if window is not None else \
        ["full_attention"] * fields["num_hidden_layers"]
    return Exaone4Config(**fields, head_dim=head_dim(reader, "exaone4"), sliding_window=window,
                         layer_types=types)


def _layer_types(reader, arch: str, fields: dict, default_period: int | None = None) -> list:
    """Each layer's kind by the file's ``attention.sliding_window_pattern``: one flag a layer
    (sliding where set), or a period whose last layer is full (``default_period`` where the
    file has none, as llama.cpp's loader reads it)."""
    layers = fields["num_hidden_layers"]
    pattern = field(reader, f"{arch}.attention.sliding_window_pattern", default_period)
    if pattern is None:
        raise ValueError(f"GGUF {arch} file: a sliding window without "
                         f"attention.sliding_window_pattern")
    sliding = [(i + 1) % pattern != 0 for i in range(layers)] if isinstance(pattern, int) \
        else [bool(flag) for flag in pattern]
    if len(sliding) != layers:
        raise ValueError(f"GGUF {arch} file: attention.sliding_window_pattern has "
                         f"{len(sliding)} entries for {layers} layers")
    return ["sliding_attention" if s else "full_attention" for s in sliding]


def ernie4_5_config(reader, tensor_names: list[str]):
    from transformers import Ernie4_5Config

    return Ernie4_5Config(**decoder_fields(reader, "ernie4_5", tensor_names),
                          head_dim=head_dim(reader, "ernie4_5"),
                          use_bias=_has(tensor_names, "q_proj.bias"))


def seed_oss_config(reader, tensor_names: list[str]):
    from transformers import SeedOssConfig

    return SeedOssConfig(
        **decoder_fields(reader, "seed_oss", tensor_names), head_dim=head_dim(reader, "seed_oss"),
        attention_bias=_has(tensor_names, "q_proj.bias"),
        attention_out_bias=_has(tensor_names, "o_proj.bias"),
        mlp_bias=_has(tensor_names, "down_proj.bias"))


def starcoder2_config(reader, tensor_names: list[str]):
    """No sliding window: llama.cpp's converter writes none and its graph applies none, and
    transformers reads such a file without one (a StarCoder2 checkpoint's 4096 would differ
    from this past 4096 tokens only)."""
    from transformers import Starcoder2Config

    fields = _layer_norm_fields(reader, "starcoder2", tensor_names, "norm_epsilon")
    return Starcoder2Config(**fields, head_dim=head_dim(reader, "starcoder2"),
                            use_bias=_has(tensor_names, "q_proj.bias"))


def phi2_config(reader, tensor_names: list[str]):
    from transformers import PhiConfig

    fields = _layer_norm_fields(reader, "phi2", tensor_names, "layer_norm_eps")
    fields["rope_parameters"]["partial_rotary_factor"] = _rotated_share(reader, "phi2")
    return PhiConfig(**fields)


def stablelm_config(reader, tensor_names: list[str]):
    from transformers import StableLmConfig

    fields = _layer_norm_fields(reader, "stablelm", tensor_names, "layer_norm_eps")
    fields["rope_parameters"]["partial_rotary_factor"] = _rotated_share(reader, "stablelm")
    return StableLmConfig(**fields, use_qkv_bias=_has(tensor_names, "q_proj.bias"),
                          use_parallel_residual=not _has(tensor_names,
                                                         "post_attention_layernorm.weight"),
                          qk_layernorm=_has(tensor_names, "q_norm.weight"))


def nemotron_config(reader, tensor_names: list[str]):
    from transformers import NemotronConfig

    fields = _layer_norm_fields(reader, "nemotron", tensor_names, "norm_eps")
    fields["rope_parameters"]["partial_rotary_factor"] = _rotated_share(reader, "nemotron")
    return NemotronConfig(**fields, head_dim=head_dim(reader, "nemotron"),
                          attention_bias=_has(tensor_names, "q_proj.bias"),
                          mlp_bias=_has(tensor_names, "down_proj.bias"))


def arcee_config(reader, tensor_names: list[str]):
    from transformers import ArceeConfig

    return ArceeConfig(**decoder_fields(reader, "arcee", tensor_names),
                       head_dim=head_dim(reader, "arcee"),
                       attention_bias=_has(tensor_names, "q_proj.bias"),
                       mlp_bias=_has(tensor_names, "down_proj.bias"))


def olmo_config(reader, tensor_names: list[str]):
    from transformers import OlmoConfig

    fields = decoder_fields(reader, "olmo", tensor_names)
    del fields["rms_norm_eps"]  # (its LayerNorms' is fixed at 1e-5)
    return OlmoConfig(**fields, clip_qkv=field(reader, "olmo.attention.clamp_kqv", None),
                      attention_bias=biases(tensor_names)["attention_bias"])


def gptneox_config(reader, tensor_names: list[str]):
    from transformers import GPTNeoXConfig

    fields = _layer_norm_fields(reader, "gptneox", tensor_names, "layer_norm_eps")
    fields["rope_parameters"]["partial_rotary_factor"] = _rotated_share(reader, "gptneox")
    del fields["num_key_value_heads"]  # (one KV head for every query head)
    return GPTNeoXConfig(**fields, hidden_act="gelu",
                         use_parallel_residual=field(reader, "gptneox.use_parallel_residual",
                                                     True),
                         attention_bias=_has(tensor_names, "qkv_proj.bias"))


def falcon_config(reader, tensor_names: list[str]):
    from transformers import FalconConfig

    fields = _layer_norm_fields(reader, "falcon", tensor_names, "layer_norm_epsilon")
    num_kv_heads, ffn_size = fields.pop("num_key_value_heads"), fields.pop("intermediate_size")
    two_norms = _has(tensor_names, "post_attention_layernorm.weight")
    new = two_norms or num_kv_heads > 1  # (7B's: one KV head, one norm)
    return FalconConfig(**fields, ffn_hidden_size=ffn_size,
                        num_kv_heads=num_kv_heads, new_decoder_architecture=new,
                        multi_query=not new, num_ln_in_parallel_attn=2 if two_norms else 1,
                        parallel_attn=True, bias=_has(tensor_names, "qkv_proj.bias"))


def gpt2_config(reader, tensor_names: list[str]):
    from transformers import GPT2Config

    return GPT2Config(**_gpt2_fields(reader, "gpt2", tensor_names))


def starcoder_config(reader, tensor_names: list[str]):
    from transformers import GPTBigCodeConfig

    fields = _gpt2_fields(reader, "starcoder", tensor_names)
    kv_heads = field(reader, "starcoder.attention.head_count_kv", 1)
    if kv_heads != 1:
        raise ValueError(f"GGUF starcoder file: {kv_heads} KV heads; only multi-query files "
                         f"(one KV head, as llama.cpp's converter writes them) are read")
    return GPTBigCodeConfig(**fields, multi_query=True)


def _gpt2_fields(reader, arch: str, tensor_names: list[str]) -> dict:
    """``decoder_fields`` under GPT-2's names (its config takes no others)."""
    fields = decoder_fields(reader, arch, tensor_names)
    return dict(vocab_size=fields["vocab_size"], n_positions=fields["max_position_embeddings"],
                n_embd=fields["hidden_size"], n_layer=fields["num_hidden_layers"],
                n_head=fields["num_attention_heads"], n_inner=fields["intermediate_size"],
                layer_norm_epsilon=fields["rms_norm_eps"],
                tie_word_embeddings=fields["tie_word_embeddings"],
                eos_token_id=fields["eos_token_id"], bos_token_id=fields["bos_token_id"])


def command_r_config(reader, tensor_names: list[str]):
    """Command R (and Aya), whose q/k norms (Command R+'s) the tensors tell."""
    from transformers import CohereConfig

    return CohereConfig(**_cohere_fields(reader, "command-r", tensor_names),
                        use_qk_norm=_has(tensor_names, "q_norm.weight"))


def cohere2_config(reader, tensor_names: list[str]):
    """Command R7B: three sliding layers to a full one, as llama.cpp's loader fixes it where
    the file has no pattern (RoPE on the sliding layers alone: the family's own rule)."""
    from transformers import Cohere2Config

    fields = _cohere_fields(reader, "cohere2", tensor_names)
    return Cohere2Config(**fields, sliding_window=field(reader, "cohere2.attention.sliding_window"),
                         layer_types=_layer_types(reader, "cohere2", fields, default_period=4))


def qwen2vl_config(reader, tensor_names: list[str]):
    from transformers import Qwen2Config

    return Qwen2Config(**_text_tower_fields(reader, "qwen2vl", tensor_names))


def qwen3vl_config(reader, tensor_names: list[str]):
    from transformers import Qwen3Config

    return Qwen3Config(**_text_tower_fields(reader, "qwen3vl", tensor_names),
                       head_dim=head_dim(reader, "qwen3vl"))


def _text_tower_fields(reader, arch: str, tensor_names: list[str]) -> dict:
    """A Qwen2-VL / Qwen2.5-VL or Qwen3-VL file read as the text decoder it holds: its
    multimodal RoPE gives a text token the same position in every section
    (``rope.dimension_sections``), which is the text model's RoPE; sections that do not
    cover each head's frequencies are refused."""
    sections = field(reader, f"{arch}.rope.dimension_sections", None)
    half = head_dim(reader, arch) // 2
    if sections is not None and sum(sections) != half:
        raise ValueError(f"GGUF {arch} file: rope.dimension_sections {list(sections)} do not "
                         f"cover the {half} frequencies of a head")
    return decoder_fields(reader, arch, tensor_names)


def _cohere_fields(reader, arch: str, tensor_names: list[str]) -> dict:
    if _rotated_share(reader, arch) != 1:
        raise ValueError(f"GGUF {arch} file: RoPE on part of each head is not implemented for "
                         f"this architecture")
    return dict(**_layer_norm_fields(reader, arch, tensor_names, "layer_norm_eps"),
                head_dim=head_dim(reader, arch),
                logit_scale=field(reader, f"{arch}.logit_scale", 1.0),
                attention_bias=_has(tensor_names, "q_proj.bias"))


def _layer_norm_fields(reader, arch: str, tensor_names: list[str], epsilon: str) -> dict:
    """``decoder_fields`` with the LayerNorm's epsilon under the family's name for it."""
    fields = decoder_fields(reader, arch, tensor_names)
    fields[epsilon] = fields.pop("rms_norm_eps")
    return fields


def _rotated_share(reader, arch: str) -> float:
    """The share of each head's features RoPE rotates (``rope.dimension_count``)."""
    dim = head_dim(reader, arch)
    return field(reader, f"{arch}.rope.dimension_count", dim) / dim


def read_rope_freqs(reader, config) -> None:
    """Llama 3's RoPE scaling, which llama.cpp's converter stores as a tensor of divisors of
    the frequencies (``rope_freqs``): into ``config`` as the ``llama3`` parameters that give
    these divisors (its factor the largest of them; Llama 3's band, 1 to 4 over an original
    context of 8192), checked against transformers' own ``llama3`` frequencies; divisors of
    another shape are refused by name."""
    import torch

    from actorlm.models.families import rope_inv_freq

    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None:
        return
    divisors = torch.tensor([float(x) for x in tensor.data], dtype=torch.float64)
    plain, _ = rope_inv_freq(config)
    params = {**(config.rope_parameters or {}), "rope_type": "llama3",
              "factor": float(divisors.max()), **_LLAMA3}
    config.rope_parameters = params
    scaled, _ = rope_inv_freq(config)
    if plain.shape != divisors.shape or not torch.allclose(
            plain.double() / scaled.double(), divisors, rtol=1e-5, atol=0):
        raise ValueError(f"GGUF file: rope_freqs.weight ({len(divisors)} divisors of the "
                         f"frequencies) is not Llama 3's scaling (factor "
                         f"{params['factor']:g}, {_LLAMA3}): not implemented")


# llama.cpp's pooling types (``{arch}.pooling_type``, which its converter writes for an
# embedding model from the sentence-transformers files) -> ours; 0 is none (a generating model)
_POOLING_TYPES = {1: "MEAN", 2: "CLS", 3: "LAST"}


def pooling_type(reader, arch: str) -> dict:
    """The config's ``gguf_pooling_type`` where the file is an embedding model's."""
    kind = field(reader, f"{arch}.pooling_type", 0)
    if kind == 0:
        return {}
    if kind not in _POOLING_TYPES:
        raise ValueError(f"the GGUF file's {arch}.pooling_type {kind} is not implemented "
                         f"(4 is a reranker's)")
    return {"gguf_pooling_type": _POOLING_TYPES[kind]}


def biases(tensor_names: list[str]) -> dict:
    """A Llama's bias flags, which its metadata lacks: the tensors tell."""
    return dict(attention_bias=_has(tensor_names, "o_proj.bias"),
                mlp_bias=_has(tensor_names, "down_proj.bias"))


def _has(tensor_names: list[str], suffix: str) -> bool:
    return any(name.endswith(suffix) for name in tensor_names)
