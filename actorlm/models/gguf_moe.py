"""The mixtures of experts of GGUF files: their configs from the metadata, their experts'
tensor names (llama.cpp's ``gguf-py/gguf/constants.py`` is the reference).

llama.cpp stores a layer's router as ``ffn_gate_inp`` [E, H], its routed experts stacked, one
3-D tensor per projection (``ffn_gate_exps``, ``ffn_up_exps`` [E, I, H] and ``ffn_down_exps``
[E, H, I], in torch order; older Mixtral files hold one tensor per expert, ``ffn_gate.{e}``…),
and Qwen2-MoE's shared expert as ``ffn_{gate,up,down}_shexp`` with its sigmoid gate
``ffn_gate_inp_shexp``, squeezed to [H] by llama.cpp's converter (a [1, H] linear weight here).

The configs, as llama.cpp's graphs compute the models (every layer routed, by the softmax's
top ``expert_used_count``):

- ``qwen3moe``, ``qwen2moe``: transformers' config of the file, but for the experts' sizes,
  which it does not read (``expert_feed_forward_length``, ``expert_shared_feed_forward_length``:
  it keeps its config class's defaults, those of Qwen3-30B-A3B and Qwen1.5-MoE-A2.7B). The top-k
  weights renormalised for Qwen3-MoE, not for Qwen2-MoE; biases where the tensors have them.
- ``llama`` with ``llama.expert_count`` > 0 is Mixtral (transformers reads it as a dense
  Llama): a ``MixtralConfig``, the top-k renormalised, q and k permuted as a Llama's.
- ``olmoe`` (transformers does not read it): an ``OlmoeConfig``, the top-k as the softmax gives
  them, q/k norms over whole projections, ``attention.clamp_kqv`` as ``clip_qkv``.
- ``granitemoe`` (transformers does not read it): a ``GraniteMoeConfig``, Granite's four
  multipliers from the file's scales (as a dense Granite's), the top-k renormalised, q and k
  permuted as a Llama's.
- ``glm4moe`` (GLM-4.5; transformers does not read it): a ``Glm4MoeConfig``, DeepSeek's routing
  from ``expert_gating_func`` (sigmoid only), ``exp_probs_b`` (the routing bias),
  ``expert_weights_norm`` and ``_scale``, ``expert_group_count`` and ``_used_count``; dense
  layers first (``leading_dense_block_count``), ``expert_shared_count`` shared experts, RoPE on
  ``rope.dimension_count`` of each head's features (halves: q and k not permuted). The file's
  ``block_count`` counts its multi-token-prediction layers (``nextn_predict_layers``, the last
  ones), which are left out (``draft_layers_from``).
- ``gpt-oss`` (transformers' reader expects other expert names): a ``GptOssConfig``, its YaRN
  (``_gpt_oss_config``), the experts' gate, up and down with their biases
  (``ffn_*_exps.bias``) and the sinks (``attn_sinks``); the experts' MXFP4 blocks become Q5_0
  ones (``gguf_file``, ``mxfp4``).
- ``ernie4_5-moe`` (ERNIE 4.5; transformers does not read it): an ``Ernie4_5_MoeConfig``,
  experts every ``interleave_moe_layer_step``-th layer from ``leading_dense_block_count`` on
  (its ``moe_layer_start_index``), ``expert_shared_count`` shared experts, the routing bias
  ``exp_probs_b``; q and k as the checkpoint's (interleaved pairs, reordered as a
  checkpoint's are). llama.cpp's converter leaves out the multi-token-prediction weights.
"""

from __future__ import annotations

import re

import torch

from actorlm.kernels import QuantizedWeight
from actorlm.models import gguf_metadata
from actorlm.models.gguf_metadata import field

# GGUF architecture -> model_type, beside the dense ones (Mixtral's files say "llama")
ARCHITECTURES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe", "olmoe": "olmoe",
                 "granitemoe": "granitemoe", "glm4moe": "glm4_moe",
                 "ernie4_5-moe": "ernie4_5_moe", "gpt-oss": "gpt_oss"}
# tensors whose Hugging Face name is not "<name>.<weight or bias>": GLM-4.5's and ERNIE 4.5's
# routing bias, GPT-OSS's sinks
WHOLE_NAMES = {"exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
               "attn_sinks.weight": "self_attn.sinks"}
# GGUF tensor name (after "blk.N.") -> the Hugging Face one (after "model.layers.N."); the
# stacked experts under a name of their own, split per expert as they are read
LAYER_NAMES = {
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_STACKED = re.compile(r"\.mlp\.experts\.(gate_proj|up_proj|down_proj)\.weight$")
_PER_EXPERT = re.compile(r"^ffn_(gate|up|down)\.(\d+)$")  # older files: one tensor an expert


def is_moe_file(reader, arch: str) -> bool:
    return arch in ARCHITECTURES or \
        (arch == "llama" and field(reader, "llama.expert_count", 0) > 0)


def draft_layers_from(reader, arch: str) -> int | None:
    """The first of the file's multi-token-prediction layers (GLM-4.5's, counted in its
    ``block_count``), which the model does not run; None: it has none."""
    draft = field(reader, f"{arch}.nextn_predict_layers", 0) if arch == "glm4moe" else 0
    return field(reader, f"{arch}.block_count") - draft if draft else None


def per_expert_name(part: str) -> str | None:
    """An older file's one expert's tensor (``ffn_gate.3``) under its Hugging Face name."""
    match = _PER_EXPERT.match(part)
    return None if match is None else f"mlp.experts.{match[2]}.{match[1]}_proj"


def torch_shape(name: str, shape: list[int]) -> list[int]:
    """The shape a tensor is handed over in: the squeezed shared-expert gate as [1, H]."""
    return [1, *shape] if name.endswith("shared_expert_gate.weight") and len(shape) == 1 \
        else shape


def is_stacked_experts(name: str, shape) -> bool:
    return len(shape) == 3 and _STACKED.search(name) is not None


def each_expert(name: str, stacked: torch.Tensor | QuantizedWeight):
    """(``mlp.experts.{e}.{projection}.weight``, expert e's [rows, columns]) of a stacked
    tensor [E, rows, columns], in floats or in blocks (a view of the stacked ones each)."""
    num_experts, rows, columns = stacked.shape
    per_expert = stacked.blocks.view(num_experts, rows, -1) \
        if isinstance(stacked, QuantizedWeight) else stacked
    for expert in range(num_experts):
        expert_name = name.replace(".mlp.experts.", f".mlp.experts.{expert}.")
        if isinstance(stacked, QuantizedWeight):
            yield expert_name, QuantizedWeight(stacked.type_name, per_expert[expert],
                                               (rows, columns))
        else:
            yield expert_name, per_expert[expert]


def moe_config(gguf, reader, tensor_names: list[str]):
    """The transformers config of the MoE file ``gguf`` (``reader`` its parsed metadata,
    ``tensor_names`` its tensors' Hugging Face names); see the module's docstring."""
    from transformers import AutoConfig, GraniteMoeConfig, MixtralConfig, OlmoeConfig

    arch = field(reader, "general.architecture")
    has_bias = any(name.endswith("q_proj.bias") for name in tensor_names)
    if arch in ("qwen3moe", "qwen2moe"):
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                            local_files_only=True)
        config.moe_intermediate_size = field(reader, f"{arch}.expert_feed_forward_length")
        config.decoder_sparse_step, config.mlp_only_layers = 1, []
        if arch == "qwen2moe":
            config.shared_expert_intermediate_size = field(
                reader, f"{arch}.expert_shared_feed_forward_length")
            config.qkv_bias, config.norm_topk_prob = has_bias, False
        else:
            config.attention_bias, config.norm_topk_prob = has_bias, True
        return config
    common = dict(gguf_metadata.decoder_fields(reader, arch, tensor_names,
                                               reads_rope_scaling=arch == "gpt-oss"),
                  num_experts_per_tok=field(reader, f"{arch}.expert_used_count"))
    hidden, heads = common["hidden_size"], common["num_attention_heads"]
    head_dim = gguf_metadata.head_dim(reader, arch)
    experts = field(reader, f"{arch}.expert_count")
    if arch == "llama":
        return MixtralConfig(**common, head_dim=head_dim, num_local_experts=experts,
                             sliding_window=None)
    if arch == "granitemoe":
        return GraniteMoeConfig(**common, num_local_experts=experts,
                                **gguf_metadata.granite_multipliers(reader, arch))
    if arch == "glm4moe":
        return _glm4moe_config(reader, common, tensor_names, experts)
    if arch == "ernie4_5-moe":
        return _ernie4_5_moe_config(reader, common, tensor_names, experts)
    if arch == "gpt-oss":
        return _gpt_oss_config(reader, common, experts)
    if head_dim * heads != hidden:  # its q norm has one weight per feature of q
        raise ValueError(f"olmoe: attention.key_length {head_dim} times {heads} heads is not "
                         f"the embedding length {hidden}")
    return OlmoeConfig(**common, num_experts=experts, norm_topk_prob=False,
                       clip_qkv=field(reader, f"{arch}.attention.clamp_kqv", None))


def _glm4moe_config(reader, common: dict, tensor_names: list[str], experts: int):
    from transformers import Glm4MoeConfig

    arch = "glm4moe"
    gating = field(reader, f"{arch}.expert_gating_func", 2)
    if gating != 2:  # (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID)
        raise ValueError(f"GGUF {arch} file: expert_gating_func {gating} is not implemented "
                         f"(only 2, sigmoid)")
    head_dim = gguf_metadata.head_dim(reader, arch)
    common["rope_parameters"]["partial_rotary_factor"] = \
        field(reader, f"{arch}.rope.dimension_count", head_dim) / head_dim
    common["num_hidden_layers"] = draft_layers_from(reader, arch) or common["num_hidden_layers"]
    return Glm4MoeConfig(
        **common, head_dim=head_dim, n_routed_experts=experts,
        n_shared_experts=field(reader, f"{arch}.expert_shared_count", 0),
        moe_intermediate_size=field(reader, f"{arch}.expert_feed_forward_length"),
        first_k_dense_replace=field(reader, f"{arch}.leading_dense_block_count", 0),
        routed_scaling_factor=field(reader, f"{arch}.expert_weights_scale", 1.0),
        norm_topk_prob=bool(field(reader, f"{arch}.expert_weights_norm", False)),
        n_group=field(reader, f"{arch}.expert_group_count", 1) or 1,
        topk_group=field(reader, f"{arch}.expert_group_used_count", 1) or 1,
        use_qk_norm=any(name.endswith("q_norm.weight") for name in tensor_names),
        attention_bias=any(name.endswith("q_proj.bias") for name in tensor_names))


def _ernie4_5_moe_config(reader, common: dict, tensor_names: list[str], experts: int):
    from transformers import Ernie4_5_MoeConfig

    arch = "ernie4_5-moe"
    if any(name.endswith("q_proj.bias") for name in tensor_names):
        raise ValueError(f"GGUF {arch} file: biases (use_bias) are not implemented")
    top_k = common.pop("num_experts_per_tok")
    return Ernie4_5_MoeConfig(
        **common, head_dim=gguf_metadata.head_dim(reader, arch), moe_num_experts=experts,
        moe_k=top_k,
        moe_intermediate_size=field(reader, f"{arch}.expert_feed_forward_length"),
        moe_num_shared_experts=field(reader, f"{arch}.expert_shared_count", 0),
        moe_layer_start_index=field(reader, f"{arch}.leading_dense_block_count", 0),
        moe_layer_interval=field(reader, f"{arch}.interleave_moe_layer_step", 1))


def _gpt_oss_config(reader, common: dict, experts: int):
    """GPT-OSS's: its YaRN from the file (type, factor, original context), with the betas and
    the untruncated ramp of its release's config, which the file leaves out; every other layer
    sliding, the first among them (llama.cpp's pattern, transformers' default)."""
    from transformers import GptOssConfig

    arch = "gpt-oss"
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "yarn":
        raise ValueError(f"GGUF {arch} file: rope scaling {scaling!r} is not implemented (yarn)")
    common["rope_parameters"].update(
        rope_type="yarn", factor=field(reader, f"{arch}.rope.scaling.factor"),
        original_max_position_embeddings=field(
            reader, f"{arch}.rope.scaling.original_context_length"),
        beta_fast=32.0, beta_slow=1.0, truncate=False)
    return GptOssConfig(**{**common, "intermediate_size": field(
        reader, f"{arch}.expert_feed_forward_length")},
        head_dim=gguf_metadata.head_dim(reader, arch), num_local_experts=experts,
        sliding_window=field(reader, f"{arch}.attention.sliding_window"), attention_bias=True)
