"""The decoder families, as their configs and checkpoints describe them.

Every family here runs on the one model of ``causal_lm.py`` (``DecoderLayer``s over the paged KV
cache); what differs is said here once: each layer's ``LayerSpec`` (norms, activation, q/k
norms, biases, attention scale, window, soft-capping), the RoPE tables and which layer rotates
by which, the embedding's scale, the final logits' soft-capping; how the checkpoint names its
tensors is ``checkpoint_names.py``'s.

- Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3: pre-norm, SiLU, RMSNorm by ``weight``.
- Ministral (8B): a Mistral whose ``layer_types`` say which layers slide. Ministral 3: a Mistral
  with YaRN and Llama 4's attention temperature, which scales the queries of positions past
  ``original_max_position_embeddings`` only: it is served within them
  (``config.positions_served``).
- SmolLM3: a Llama that leaves RoPE out of the layers its ``no_rope_layers`` mark 0 (every
  fourth by default): they rotate by an identity table (``NO_ROPE``).
- Granite: a Llama with four multipliers: the embeddings', the attention scores' (in place of
  1/sqrt(head_dim)), each branch's output before it joins the stream, and the logits' divisor.
- OLMo (1, OLMo-7B-0724): a Llama with LayerNorms that learn no weight nor bias and q, k and
  v clamped to ``clip_qkv`` after their projections.
- OLMo 2 and OLMo 3: norms on the attention's and the MLP's outputs only, none on their
  inputs, and OLMoE's q/k norms over whole projections; OLMo 3's sliding-window layers (three
  to each full one) have RoPE parameters of their own.
- EXAONE 4: OLMo 2's norms after the branches only, per-head q/k norms, and, with a sliding
  window, three sliding layers with RoPE to each full one without (global NoPE).
- GLM and GLM-4: RoPE on the first half of each head in interleaved pairs (``rope_layout``
  reorders q and k for it), q/k/v biases but none on o, q/k/v and gate/up fused in the
  checkpoint as Phi-3's; GLM-4 norms the attention's and the MLP's outputs too.
- ERNIE 4.5 (dense): a Llama with RoPE on interleaved pairs (as GLM's, on every feature) and,
  with ``use_bias``, a bias on every projection.
- Helium: a Llama with RoPE on interleaved pairs; Seed-OSS: a Llama with q/k/v biases and
  o_proj's by ``attention_out_bias``.
- Phi-3: a Llama whose checkpoint fuses q/k/v (``qkv_proj``) and gate/up (``gate_up_proj``);
  Phi-4-mini turns RoPE on three quarters of each head; Phi-3.5's and Phi-4-mini's LongRoPE
  turns by its short factors within the original context and by its long ones beyond it
  (``long_rope_from``).
- Gemma (1, CodeGemma): a Llama whose norms scale by ``1 + weight``, with GeLU (tanh) and the
  embedding scaled by sqrt(hidden).
- Gemma 2 and Gemma 3: Gemma's, with four norms a layer (before and after attention and MLP),
  attention scaled by ``query_pre_attn_scalar``; Gemma 2 soft-caps attention scores and the
  final logits, Gemma 3 norms q and k and gives its sliding layers their own RoPE base.
- Checkpoints with a vision tower (Gemma 3, Mistral 3, LLaVA, Qwen2-VL, Qwen2.5-VL, Qwen3-VL)
  are served as their text decoder (``TEXT_TOWERS``); the API refuses image parts. Qwen's
  multimodal RoPE turns each of its sections by one of three positions (time, height,
  width), which are all the token's own position in a text: it is then a plain RoPE.
- StarCoder2, Phi-2, Cohere (Command R, Aya) and Cohere 2 (Command R7B, Command A):
  LayerNorm in place of RMSNorm (with a bias but in Cohere's); StarCoder2's and Phi-2's MLPs
  ungated (GeLU of one projection); Phi-2's and Cohere's attention and MLP in parallel from
  one norm, summed; Phi-2's LM head has a bias, Cohere's logits are scaled (``logit_scale``)
  and its RoPE turns interleaved pairs; Cohere 2's sliding layers (three to each full one)
  alone turn by RoPE, as EXAONE 4's.
- StableLM (StableLM 2, StableLM-3B-4E1T, StableCode): a Llama with LayerNorms (with biases),
  RoPE on a quarter of each head, q/k/v biases by ``use_qkv_bias``, and with
  ``use_parallel_residual`` attention and MLP in parallel from one norm, as Phi-2's; StableLM
  2 12B's per-head q/k LayerNorms are refused by name.
- Nemotron (Minitron, Nemotron-Mini): LayerNorms with biases whose weights count from 1
  (``LayerNorm1P``: the 1 is added as the checkpoint loads), an ungated MLP of ReLU squared
  (``up_proj``, ``down_proj``), RoPE on half of each head. Arcee (AFM): a Llama with that MLP.
- GPT-NeoX (Pythia, Dolly v2, RedPajama-INCITE, GPT-NeoX-20B): LayerNorms with biases, an
  ungated MLP of exact (erf) GeLU with biases, RoPE on a quarter of each head; q/k/v fused per
  head in the checkpoint (``query_key_value``: each head's q, k and v rows together); with
  ``use_parallel_residual`` the attention and the MLP read the same stream, each through its
  own norm, and are summed.
- Falcon (7B, 40B, 180B, Falcon 2 11B): GPT-NeoX's LayerNorms and exact GeLU MLP under its
  own names, biases by ``bias``, RoPE on whole heads; one KV head (``multi_query``, 7B's) or
  ``num_kv_heads`` groups (the new decoder architecture's, whose fused q/k/v holds each
  group's queries, then its key and value), attention and MLP in parallel from one norm, or
  each from its own (``ln_attn``, ``ln_mlp``). ALiBi (Falcon-RW) is refused by name.
- GPT-BigCode (StarCoder, SantaCoder, WizardCoder, OctoCoder): GPT-2's layout (learned
  positions, LayerNorms, GeLU, biases) with Linear weights and one KV head (``multi_query``:
  q/k/v fused as all queries, the key, the value; without it, each head's q, k and v).
- OPT (vLLM's quick-start model, facebook/opt-125m and its larger siblings): LayerNorm with a
  bias, an ungated ReLU MLP (``fc1``, ``fc2``), biases everywhere, no RoPE: positions are
  learned embeddings added to the tokens' (row position + 2, ``position_offset``). The
  post-norm of OPT-350m (``do_layer_norm_before`` false) and its projections in and out of a
  narrower embedding (``word_embed_proj_dim``) are refused by name.
- GPT-2 (and DistilGPT2): OPT's layout with GeLU (tanh) and learned positions from row 0; its
  checkpoint's Conv1D weights are stored [in, out] (transposed as they load), q/k/v fused
  (``c_attn``), and its first checkpoints leave out the ``transformer.`` prefix and keep the
  causal masks as tensors (dropped).
- Qwen3-MoE, Mixtral, Qwen2-MoE, OLMoE: routed experts in place of some or all dense MLPs
  (``moe_families.py`` says which and how they route; ``moe.py`` computes them).
- GPT-OSS (gpt-oss-20b, -120b): a Llama with biases on q/k/v and o, a learned sink logit per
  head in each softmax, sliding layers alternating with full ones, YaRN, and routed experts
  with biases and their clamped SwiGLU (``moe_families``).

A config field that changes the math and is not implemented is refused by name
(``check_config``), never dropped.
"""

from __future__ import annotations

import math

import torch

from actorlm.models.decoder import LayerSpec
from actorlm.models.moe_families import (MOE_MODEL_TYPES, check_moe_config,
                                         intermediate_size_of, is_moe, moe_specs)
from actorlm.models.rope_layout import head_order

# a multimodal checkpoint's model_type -> the model_type its text decoder is read as (None:
# the text config's own)
TEXT_TOWERS = {"gemma3": None, "mistral3": None, "llava": None, "llava_next": None,
               "qwen2_vl": "qwen2", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "ministral", "ministral3", "qwen2", "qwen3", "phi3",
                         "smollm3", "granite",
                         "olmo2", "olmo3", "exaone4", "glm", "glm4", "ernie4_5", "helium",
                         "seed_oss", "gemma", "gemma2", "gemma3_text", "starcoder2", "phi",
                         "cohere", "cohere2", "opt", "gpt2", "stablelm", "nemotron", "arcee",
                         "gpt_neox", "falcon", "olmo", "gpt_bigcode", "hunyuan_v1_dense",
                         *TEXT_TOWERS,
                         *MOE_MODEL_TYPES)
# the RoPE table of the layers without RoPE (SmolLM3's, EXAONE 4's and Cohere 2's global
# ones): the identity
NO_ROPE = "no_rope"
_QK_NORMS = {"qwen3": "head", "gemma3_text": "head", "qwen3_moe": "head", "olmoe": "projection",
             "olmo2": "projection", "olmo3": "projection", "exaone4": "head",
             "hunyuan_v1_dense": "head_after_rope", "hunyuan_v1_moe": "head_after_rope"}
_OUTPUT_NORMS_ONLY = ("olmo2", "olmo3", "exaone4")  # norms on the branches' outputs only
_COHERE = ("cohere", "cohere2")
# RoPE on (2i, 2i + 1)
_INTERLEAVED_ROPE = ("glm", "glm4", "ernie4_5", "ernie4_5_moe", "helium", *_COHERE)
# LayerNorm, with a bias but in Cohere's
_LAYER_NORM = ("starcoder2", "phi", "opt", "gpt2", "gpt_bigcode", "stablelm", "nemotron",
               "gpt_neox", "falcon", "olmo", *_COHERE)
_NO_NORM_BIAS = ("olmo", *_COHERE)  # (OLMo's LayerNorms learn no weight either)
# attention and MLP from one norm, in parallel (StableLM's and GPT-NeoX's by their
# use_parallel_residual, GPT-NeoX's MLP through a norm of its own)
_PARALLEL = ("phi", *_COHERE)
_PARALLEL_BY_CONFIG = ("stablelm", "gpt_neox")
_UNGATED_MLP = ("starcoder2", "phi", "opt", "gpt2", "gpt_bigcode", "nemotron", "arcee",
                "gpt_neox", "falcon")
# learned position embeddings (no RoPE): the row a position reads is position + offset
_POSITION_OFFSETS = {"opt": 2, "gpt2": 0, "gpt_bigcode": 0}
# a family's config fields whose other values change the math and are not computed here
# (OPT-350m's post-norm; GPT-2's scaling by layer, its cross-attention) -> the value computed
_COMPUTED_ONLY = {"opt": {"do_layer_norm_before": True, "_remove_final_layer_norm": False,
                          "layer_norm_elementwise_affine": True},
                  "gpt2": {"scale_attn_weights": True, "add_cross_attention": False,
                           "scale_attn_by_inverse_layer_idx": False},
                  "gpt_bigcode": {"scale_attn_weights": True, "add_cross_attention": False},
                  "falcon": {"alibi": False},
                  # (the kernels' clamped SwiGLU: backend.SWIGLU_OAI_LIMIT, SWIGLU_OAI_ALPHA)
                  "gpt_oss": {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}}
# a query/key norm the family's config may turn on, not implemented (a LayerNorm per head)
# the config flag of each head's q/k LayerNorm: per head (Cohere's, StableLM's) or one for all
# heads, with a bias (Phi's)
_QK_LAYER_NORMS = {"phi": "qk_layernorm", "cohere": "use_qk_norm", "stablelm": "qk_layernorm"}
_GEMMA = ("gemma", "gemma2", "gemma3_text")
_GRANITE = ("granite", "granitemoe", "granitemoeshared")  # Granite's four multipliers
_FOUR_NORMS = ("gemma2", "gemma3_text")  # Gemma 1 has a Llama's two
# a config's activation -> the kernels' name for it (Phi-2's gelu_new is the tanh
# approximation, written out in torch ops)
ACTIVATION_NAMES = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                    "gelu_fast": "gelu_tanh", "relu": "relu", "relu2": "relu2", "gelu": "gelu"}
# the activations a family's configs name (by ACTIVATION_NAMES' names; the rest: SiLU); any
# other is refused
_FAMILY_ACTIVATIONS = {**dict.fromkeys(("starcoder2", "phi", "gpt2", "gpt_bigcode", *_GEMMA),
                                        ("gelu_tanh",)),
                       "opt": ("relu",), "nemotron": ("relu2",), "arcee": ("relu2",),
                       "falcon": ("gelu",),
                       # (Pythia's exact GeLU, GPT-NeoX-20B's gelu_fast)
                       "gpt_neox": ("gelu", "gelu_tanh")}
_GRANITE_MULTIPLIERS = ("embedding_multiplier", "attention_multiplier", "residual_multiplier",
                        "logits_scaling")

# a checkpoint's norm names -> the shared decoder layer's (Llama's "post-attention" norm is
# the one before the MLP; Gemma's and OLMo 2's is the attention output's own)
_LLAMA_NORMS = {".input_layernorm.": ".attn_norm.", ".post_attention_layernorm.": ".mlp_norm."}
_OUTPUT_NORMS = {".input_layernorm.": ".attn_norm.",
                 ".post_attention_layernorm.": ".attn_out_norm.",
                 ".pre_feedforward_layernorm.": ".mlp_norm.",
                 ".post_feedforward_layernorm.": ".mlp_out_norm."}
# GLM-4's four: its "post-attention" norm is the one before the MLP, as a Llama's
_GLM4_NORMS = {**_LLAMA_NORMS, ".post_self_attn_layernorm.": ".attn_out_norm.",
               ".post_mlp_layernorm.": ".mlp_out_norm."}



def text_config(config, has_lm_head: bool = False):
    """The config of the text decoder: a multimodal checkpoint's ``text_config`` (read as
    ``TEXT_TOWERS`` says), its LM head tied to the embeddings as transformers ties it: by the
    outer config's flag, unless the checkpoint ``has_lm_head`` of its own."""
    if config.model_type not in TEXT_TOWERS:
        return config
    text, read_as = config.text_config, TEXT_TOWERS[config.model_type]
    if read_as is not None:
        from transformers import AutoConfig

        fields = {k: v for k, v in text.to_dict().items()
                  if k not in ("model_type", "transformers_version", "architectures")}
        text = AutoConfig.for_model(read_as, **fields)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False)) and \
        not has_lm_head
    return text


def is_gemma(config) -> bool:
    return config.model_type in _GEMMA


def check_config(config) -> None:
    """Refuse, by name, what ``config`` asks for that this engine does not compute."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {config.model_type!r} is not supported (use one of "
                         f"{SUPPORTED_MODEL_TYPES})")
    activation = activation_of(config)
    if ACTIVATION_NAMES.get(activation) not in _FAMILY_ACTIVATIONS.get(config.model_type,
                                                                       ("silu",)):
        raise ValueError(f"{config.model_type}: activation {activation!r} is not implemented")
    for name, computed in _COMPUTED_ONLY.get(config.model_type, {}).items():
        if getattr(config, name, computed) != computed:
            raise ValueError(f"{config.model_type}: {name}={getattr(config, name)!r} is not "
                             f"implemented")
    if getattr(config, "word_embed_proj_dim", config.hidden_size) != config.hidden_size:
        raise ValueError(f"{config.model_type}: word_embed_proj_dim="
                         f"{config.word_embed_proj_dim} (embeddings projected in and out of "
                         f"the hidden size {config.hidden_size}) is not implemented")
    rope_head_order(config)  # refuses a RoPE layout the reordering cannot express
    if getattr(config, "use_bidirectional_attention", False) and \
            config.model_type != "gemma3_text":
        raise ValueError(f"{config.model_type}: use_bidirectional_attention is not implemented "
                         f"(Gemma 3's, EmbeddingGemma's, is)")
    for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"):
        value = getattr(config, name, None) if is_gemma(config) else None
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}")
    if not is_gemma(config):
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(config, name, None) is not None:
                raise ValueError(f"{name} is not implemented for {config.model_type}")
    if config.model_type in _GRANITE:
        for name in _GRANITE_MULTIPLIERS:
            value = getattr(config, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value)) or \
                    (name == "logits_scaling" and not value > 0):
                raise ValueError(f"{config.model_type}: {name} must be a finite number"
                                 f"{' above 0' if name == 'logits_scaling' else ''}, got "
                                 f"{value!r}")
    if is_moe(config):
        check_moe_config(config)


def _bias(config, name: str) -> bool:
    """A family's flag for biases on these projections: its own ``name``, or one for every
    projection (ERNIE's ``use_bias``, OPT's ``enable_bias``, Falcon's ``bias``)."""
    every = ("use_bias", "enable_bias", *(("bias",) if config.model_type == "falcon" else ()))
    for flag in (name, *every):
        if (value := getattr(config, flag, None)) is not None:
            return bool(value)
    return False


def activation_of(config) -> str:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None) \
        or getattr(config, "activation_function", None) or getattr(config, "activation", "silu")


def position_offset(config) -> int | None:
    """Where a model has learned position embeddings (OPT), the row position 0 reads (OPT's
    first two rows are never read); None: the model has none."""
    return _POSITION_OFFSETS.get(config.model_type)


def layer_windows(config) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as transformers applies them:
    ``layer_types`` where the config has them (Qwen2/3 with ``use_sliding_window``, Gemma),
    else a ``sliding_window`` on every layer (Mistral, Phi-3)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return [window] * config.num_hidden_layers
    if "sliding_attention" in layer_types and not window:
        raise ValueError("layer_types name sliding_attention layers but sliding_window is unset")
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def layer_specs(config) -> list[LayerSpec]:
    """Every decoder layer of the model, as its config describes it."""
    check_config(config)
    gemma, model_type = is_gemma(config), config.model_type
    # (Mixtral's attention has no biases, whatever its config says; ERNIE's use_bias puts one
    # on every projection)
    attention_bias = _bias(config, "attention_bias") and model_type != "mixtral"
    qwen2 = model_type in ("qwen2", "qwen2_moe")
    # Qwen2's q/k/v always have a bias, Qwen2-MoE's by qkv_bias; neither has one on o_proj
    qkv_bias = (model_type == "qwen2" or bool(getattr(config, "qkv_bias", True))) if qwen2 \
        else bool(config.use_qkv_bias) if model_type == "stablelm" else attention_bias
    head_dim = head_dim_of(config)
    scalar = getattr(config, "query_pre_attn_scalar", None) if gemma else None
    # (Phi-2's and GPT-2's projections all have biases, whatever their config says)
    granite, biased = model_type in _GRANITE, model_type in ("phi", "gpt2", "gpt_bigcode")
    base = dict(
        hidden_size=config.hidden_size, num_heads=config.num_attention_heads,
        num_kv_heads=num_kv_heads_of(config),
        head_dim=head_dim, intermediate_size=intermediate_size_of(config),
        norm_eps=norm_eps(config), norm_unit_offset=gemma,
        layer_norm=model_type in _LAYER_NORM,
        norm_bias=model_type in _LAYER_NORM and model_type not in _NO_NORM_BIAS,
        norm_weight=model_type != "olmo",
        parallel=_parallel(config), parallel_mlp_norm=_own_mlp_norm(config),
        qkv_groups=qkv_groups(config),
        gated_mlp=model_type not in _UNGATED_MLP,
        output_norms=model_type in (*_FOUR_NORMS, *_OUTPUT_NORMS_ONLY, "glm4"),
        input_norms=model_type not in _OUTPUT_NORMS_ONLY,
        qk_norm=_qk_norm(config),
        qk_norm_bias=model_type == "phi",
        clip_qkv=getattr(config, "clip_qkv", None) if model_type in ("olmoe", "olmo") else None,
        # (GPT-OSS's experts use their clamped SwiGLU, whatever hidden_act says)
        activation="swiglu_oai" if model_type == "gpt_oss" else
        ACTIVATION_NAMES[activation_of(config)],
        qkv_bias=qkv_bias or biased, o_bias=_o_bias(config, attention_bias) or biased,
        # (the MoE families' MLPs have no biases, whatever their config says)
        mlp_bias=biased or model_type == "gpt_neox" or
        _bias(config, "mlp_bias") and not is_moe(config),
        attention_scale=config.attention_multiplier if granite else
        None if scalar is None else scalar**-0.5,
        softcap=getattr(config, "attn_logit_softcapping", None) if gemma else None,
        residual_scale=config.residual_multiplier if granite else None,
        rope_order=rope_head_order(config),
        bidirectional=bool(getattr(config, "use_bidirectional_attention", False)),
        sinks=model_type == "gpt_oss")
    return [LayerSpec(**base, window=window, moe=moe)
            for window, moe in zip(layer_windows(config), moe_specs(config), strict=True)]


def qkv_groups(config) -> int:
    """How a checkpoint's fused q/k/v (and so a LoRA adapter's) holds its rows: 0, all q, then
    all k, then all v; n, in n groups of a group's query heads, its key and its value: a group a
    head (GPT-NeoX's, GPT-BigCode's and Falcon's first decoder's without multi-query), a group a
    KV head (Falcon's new decoder architecture's)."""
    model_type = config.model_type
    if model_type == "gpt_neox" or model_type == "gpt_bigcode" and not config.multi_query:
        return config.num_attention_heads
    if model_type == "falcon":
        if config.new_decoder_architecture:
            return config.num_kv_heads
        return 0 if config.multi_query else config.num_attention_heads
    return 0


def _qk_norm(config) -> str | None:
    """The layers' q/k norms (``LayerSpec.qk_norm``): each head's LayerNorm where the config's
    flag asks for one, GLM-4.5's by ``use_qk_norm``, else the family's."""
    if has_head_layer_norms(config):
        return "head_layer"
    if config.model_type == "glm4_moe":
        return "head" if config.use_qk_norm else None
    return _QK_NORMS.get(config.model_type)


def has_head_layer_norms(config) -> bool:
    """Whether each head's q and k go through a LayerNorm before RoPE (Cohere's
    ``use_qk_norm``, StableLM's and Phi's ``qk_layernorm``)."""
    flag = _QK_LAYER_NORMS.get(config.model_type)
    return flag is not None and bool(getattr(config, flag, False))


def _parallel(config) -> bool:
    """Whether attention and MLP read the same stream and are summed: Phi-2's and Cohere's
    always, StableLM's and GPT-NeoX's by ``use_parallel_residual``, Falcon's by
    ``parallel_attn`` or its new decoder architecture."""
    if config.model_type == "falcon":
        return bool(config.parallel_attn or config.new_decoder_architecture)
    if config.model_type in _PARALLEL_BY_CONFIG:
        return bool(config.use_parallel_residual)
    return config.model_type in _PARALLEL


def _own_mlp_norm(config) -> bool:
    """Whether a parallel layer's MLP reads a norm of its own: GPT-NeoX's, and Falcon's new
    decoder architecture's (``ln_mlp``; Falcon-40B's and -180B's) unless
    ``num_ln_in_parallel_attn`` is 1."""
    if config.model_type == "falcon":
        return config.new_decoder_architecture and (config.num_ln_in_parallel_attn or 2) == 2
    return config.model_type == "gpt_neox"


def _o_bias(config, attention_bias: bool) -> bool:
    """Whether o_proj has a bias: as q/k/v do, but never in Qwen2's, GLM's (GLM-4.5's) or
    Helium's, and by its own flag in Seed-OSS's."""
    if config.model_type == "seed_oss":
        return bool(config.attention_out_bias)
    return attention_bias and config.model_type not in ("qwen2", "qwen2_moe", "glm", "glm4",
                                                        "glm4_moe", "helium")


def norm_eps(config) -> float:
    """The norms' epsilon, by whichever name the family's config gives it (OPT's and OLMo's
    none: torch's LayerNorm default, as transformers builds them)."""
    for name in ("rms_norm_eps", "layer_norm_eps", "norm_epsilon", "layer_norm_epsilon",
                 "norm_eps"):
        if (value := getattr(config, name, None)) is not None:
            return value
    if config.model_type in ("opt", "olmo"):  # (OLMo's, fixed in its LayerNorm)
        return 1e-5
    raise ValueError(f"{config.model_type}: the config names no norm epsilon")


def lm_head_bias(config) -> bool:
    """Whether the LM head adds a bias (Phi-2's does)."""
    return config.model_type == "phi"


def num_kv_heads_of(config) -> int:
    """The KV heads: the config's count (all heads where it names none), or GPT-BigCode's by
    its ``multi_query``, which its model reads (its ``num_key_value_heads`` may disagree)."""
    if config.model_type == "gpt_bigcode":
        return 1 if config.multi_query else config.num_attention_heads
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def norm_names(config) -> dict[str, str]:
    """The checkpoint's norm names -> the decoder layer's."""
    if config.model_type == "glm4":
        return _GLM4_NORMS
    output_norms = config.model_type in (*_FOUR_NORMS, *_OUTPUT_NORMS_ONLY)
    return _OUTPUT_NORMS if output_norms else _LLAMA_NORMS


def embedding_scale(config, dtype: torch.dtype, device=None) -> torch.Tensor | float | None:
    """What the embeddings are multiplied by: Gemma's sqrt(hidden), rounded to the model dtype
    as transformers does, Granite's ``embedding_multiplier``; None: nothing."""
    if is_gemma(config):
        return torch.tensor(config.hidden_size**0.5, dtype=dtype, device=device)
    return config.embedding_multiplier if config.model_type in _GRANITE else None


def logits_divisor(config) -> float | None:
    """What the logits are divided by (Granite's ``logits_scaling``, the reciprocal of
    Cohere's ``logit_scale``); None: nothing."""
    if config.model_type in _COHERE and config.logit_scale is not None:
        return 1 / config.logit_scale
    return config.logits_scaling if config.model_type in _GRANITE else None


def rope_layer_types(config) -> list[str | None]:
    """The RoPE table each layer rotates by: a layer type where the config keeps RoPE
    parameters per type (Gemma 3), ``NO_ROPE`` where ``no_rope_layers`` says 0 (SmolLM3) or,
    in a model with sliding windows, on its full-attention layers (EXAONE 4's and Cohere 2's
    global NoPE),
    else None (one table for all)."""
    params = getattr(config, "rope_parameters", None) or {}
    layers = config.num_hidden_layers
    types = list(config.layer_types) if "sliding_attention" in params else [None] * layers
    uses_rope = getattr(config, "no_rope_layers", None) or \
        [int(position_offset(config) is None)] * layers  # (learned positions: no RoPE)
    if config.model_type in ("exaone4", "cohere2") and getattr(config, "sliding_window", None):
        uses_rope = [kind == "sliding_attention" for kind in config.layer_types]
    if len(uses_rope) < layers:
        raise ValueError(f"no_rope_layers has {len(uses_rope)} entries for {layers} layers")
    return [kind if rope else NO_ROPE for kind, rope in zip(types, uses_rope)]


def rope_head_order(config) -> tuple[int, ...] | None:
    """How each head's q and k features are reordered at load (``rope_layout``): for RoPE on
    part of each head (``partial_rotary_factor``) or on interleaved pairs (GLM's)."""
    rope = _rope_parameters(config)
    factors = {(params or {}).get("partial_rotary_factor",
                                  getattr(config, "partial_rotary_factor", None)) or 1.0
               for params in (rope.values() if "sliding_attention" in rope else [rope])}
    if len(factors) > 1:
        raise ValueError(f"partial_rotary_factor {sorted(factors)}, one per layer type, is not "
                         f"implemented")
    head_dim = head_dim_of(config)
    return head_order(head_dim, int(head_dim * factors.pop()),  # (transformers' rounding)
                      config.model_type in _INTERLEAVED_ROPE)


def _rope_parameters(config) -> dict:
    """transformers 5's ``rope_parameters``, or an older config's ``rope_scaling``."""
    return getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}


def _rope_type(params: dict) -> str:
    return params.get("rope_type", params.get("type", "default"))


def long_rope_from(config) -> int | None:
    """LongRoPE's original context (``original_max_position_embeddings``): a request whose
    context reaches past it (its prompt, or a position it decodes at) rotates by the long
    factors, the rest by the short ones, as transformers picks them per forward over a
    sequence. None: not LongRoPE."""
    params = _rope_parameters(config)
    if _rope_type(params) != "longrope":
        if any(isinstance(p, dict) and _rope_type(p) == "longrope" for p in params.values()):
            raise ValueError("LongRoPE in rope_parameters per layer type is not implemented")
        return None
    original = params.get("original_max_position_embeddings") or \
        getattr(config, "original_max_position_embeddings", None)
    if not (isinstance(original, int) and original > 0):
        raise ValueError(f"LongRoPE needs a positive original_max_position_embeddings, got "
                         f"{original!r}")
    return original


def rope_inv_freq(config, layer_type: str | None = None, device=None,
                  long: bool = False) -> tuple[torch.Tensor, float]:
    """(inv_freq [R/2] fp32, attention_scaling) through transformers' own RoPE init functions,
    for the layers of ``layer_type`` where the config has RoPE parameters per layer type (R:
    the features RoPE turns, the head's D or ``partial_rotary_factor`` of them); ``long``:
    LongRoPE's long factors (its short ones otherwise).

    transformers 5 keeps ``rope_theta`` and the scaling type in ``config.rope_parameters``;
    older versions have ``rope_theta`` and ``rope_scaling`` attributes.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = _rope_parameters(config)
    if layer_type is not None:
        params = params[layer_type]
    rope_type = _rope_type(params)
    # (dynamic NTK: within the context it is served for, config.positions_served, the
    # frequencies transformers starts from, those of its unscaled base)
    if rope_type == "dynamic" and params.get("alpha"):
        # Hunyuan's NTK-alpha (its checkpoints say "dynamic"): a fixed base, stretched by
        # alpha ** (D / (D - 2)), whatever the sequence's length
        dim = head_dim_of(config)
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0)) * \
            params["alpha"] ** (dim / (dim - 2))
        return 1.0 / (theta ** (torch.arange(0, dim, 2, device=device).float() / dim)), 1.0
    if long:  # transformers' choice for a sequence one longer than the original context
        return ROPE_INIT_FUNCTIONS[rope_type](config, device, seq_len=long_rope_from(config) + 1)
    if rope_type == "default" and "default" not in ROPE_INIT_FUNCTIONS:
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = int(head_dim_of(config) * (params.get("partial_rotary_factor") or 1.0))
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float().to(device) / dim))
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope type {rope_type!r} is not implemented")
    kwargs = {} if layer_type is None else {"layer_type": layer_type}
    return ROPE_INIT_FUNCTIONS[rope_type](config, device, **kwargs)
