"""The mixture-of-experts families, as their configs describe them (transformers'
``modeling_{qwen3_moe,mixtral,qwen2_moe,olmoe}.py`` are the reference).

- Qwen3-MoE: Qwen3's layers (per-head q/k norms) with routed experts of
  ``moe_intermediate_size`` where ``(layer + 1) % decoder_sparse_step == 0`` and the layer is
  not in ``mlp_only_layers`` (the others keep a dense MLP of ``intermediate_size``); the top-k
  weights are renormalised with ``norm_topk_prob``.
- Qwen2-MoE: the same choice of layers on Qwen2's attention (a qkv bias by ``qkv_bias``), and a
  shared expert of ``shared_expert_intermediate_size`` beside the routed ones, scaled by
  ``sigmoid(shared_expert_gate(x))``.
- Mixtral: Mistral's layers, every one routed (experts of ``intermediate_size``), the top-k
  weights always renormalised; its checkpoint names the block ``block_sparse_moe`` and the
  experts' projections ``w1`` (gate), ``w3`` (up), ``w2`` (down).
- OLMoE: every layer routed (experts of ``intermediate_size``), renormalised with
  ``norm_topk_prob``; q and k are normed over their whole projections (all heads at once,
  weights [Hq * D] and [Hkv * D]), not per head, and ``clip_qkv`` clamps q, k and v after.
- Granite MoE (Granite 3.x's 1B-A400M, 3B-A800M): Granite's layers and multipliers
  (``families``), every layer routed as Mixtral's (its softmax over the top-k logits is the
  renormalised top k of the softmax); its checkpoint stacks each layer's experts
  (``block_sparse_moe.input_linear`` [E, 2I, H], gate rows first, and ``output_linear``
  [E, H, I]: the stacked layout ``expert_weights`` reads) and names the router
  ``router.layer``. Its shared variant (``granitemoeshared``) adds a dense MLP of
  ``shared_intermediate_size`` every token takes, unscaled (``shared_mlp.input_linear``
  [2 I, H], gate rows first, and ``output_linear``); 0 means none.

- GLM-4.5 (``glm4_moe``: GLM-4.5, GLM-4.5-Air, GLM-4.6): dense MLPs in the first
  ``first_k_dense_replace`` layers, then routed experts of ``moe_intermediate_size`` beside an
  unscaled shared MLP of ``n_shared_experts`` times that size; DeepSeek's routing: the top k
  of sigmoid(logits) + ``e_score_correction_bias`` within the ``topk_group`` best of
  ``n_group`` groups, weighted by their sigmoids (renormalised by ``norm_topk_prob``) times
  ``routed_scaling_factor``, the router in fp32. Its checkpoints' multi-token-prediction
  layers (past ``num_hidden_layers``) are left out, as transformers leaves them.
- Hunyuan (``hunyuan_v1_moe``: Hunyuan-A13B): Hunyuan's dense layers (``families``: q/k norms
  after RoPE, NTK-alpha RoPE) with every MLP routed, experts of ``intermediate_size`` beside an
  unscaled shared MLP of that size (``shared_mlp``); the top ``moe_topk`` of the softmax,
  renormalised, the router (``gate.wg``) in fp32. ``num_experts`` and ``moe_topk`` may be
  listed per layer: the same for every layer only.
- ERNIE 4.5 (``ernie4_5_moe``: ERNIE-4.5-21B-A3B, -300B-A47B, their Thinking): ERNIE 4.5's
  attention (RoPE on interleaved pairs) with experts of ``moe_intermediate_size`` on every
  ``moe_layer_interval``-th layer from ``moe_layer_start_index`` to ``moe_layer_end_index``
  (dense MLPs elsewhere) beside an unscaled shared MLP of ``moe_num_shared_experts`` times
  that size; the top k of the softmax plus ``moe_statics.e_score_correction_bias``, weighted
  by the softmax renormalised (by a sum of at least ``moe_norm_min``); its
  multi-token-prediction weights (``mtp``) are left out. ``use_bias`` is refused.
- GPT-OSS: every layer routed, experts of ``intermediate_size``, the top k of the router's
  logits (``router``, with a bias) weighted by their softmax (the renormalised top k of the
  softmax); each expert's projections have biases and its activation is the clamped SwiGLU
  (``kernels.backend.ACTIVATIONS``' ``swiglu_oai``). Its checkpoint stacks the experts
  transposed, gate and up features interleaved (``gate_up_proj`` [E, H, 2I], ``down_proj``
  [E, I, H]): ``gpt_oss_tensor`` lays them out as the other families' stacked experts.

The others route by the softmax of the router's logits (in fp32) and its top
``num_experts_per_tok``. Fields of other MoE families that would change the routing
(DeepSeek's grouped top-k and scaling, a router bias…) are refused by name when a config of
these carries them: transformers' code for these families ignores them, so a config that sets
them describes another model. ``router_jitter_noise``, ``router_aux_loss_coef`` and
``output_router_logits`` matter only in training and are ignored, as in transformers.
"""

from __future__ import annotations

import re

import torch

from actorlm.models.moe import MoeSpec

_GRANITE_MOE = ("granitemoe", "granitemoeshared")
MOE_MODEL_TYPES = ("qwen3_moe", "mixtral", "qwen2_moe", "olmoe", *_GRANITE_MOE, "glm4_moe",
                   "ernie4_5_moe", "hunyuan_v1_moe", "gpt_oss")
# routed by scores and a learned bias (DeepSeek's routing, ERNIE's): their fields are read
_SCORED = ("glm4_moe", "ernie4_5_moe")
# every layer routed, experts of intermediate_size
_EVERY_LAYER = ("mixtral", "olmoe", *_GRANITE_MOE, "hunyuan_v1_moe", "gpt_oss")
# the top-k weights, whatever norm_topk_prob says
_RENORMALIZED = ("mixtral", *_GRANITE_MOE, "ernie4_5_moe", "hunyuan_v1_moe", "gpt_oss")
# field -> the values that leave the routing as these families compute it
_OTHER_ROUTING = {
    "routed_scaling_factor": (None, 1, 1.0),
    "n_group": (None, 0, 1),
    "topk_group": (None, 0, 1),
    "topk_method": (None, "greedy"),
    "scoring_func": (None, "softmax"),
    "router_bias": (None, False),
    "moe_router_bias": (None, False),
    "n_shared_experts": (None, 0),
    "first_k_dense_replace": (None, 0),
}
_GPT_OSS_NAMES = {".mlp.router.": ".mlp.gate.",
                  ".mlp.experts.gate_up_proj_bias": ".mlp.experts.gate_up_bias",
                  ".mlp.experts.down_proj_bias": ".mlp.experts.down_bias",
                  ".mlp.experts.gate_proj.bias": ".mlp.experts.gate_bias",
                  ".mlp.experts.up_proj.bias": ".mlp.experts.up_bias",
                  ".mlp.experts.down_proj.bias": ".mlp.experts.down_bias"}
# GPT-OSS's experts stacked [E, in, out], and those whose gate and up features interleave
_GPT_OSS_STACKED = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
_GPT_OSS_INTERLEAVED = (".mlp.experts.gate_up_proj", ".mlp.experts.gate_up_bias")
EXPERTS_SIZE = "experts' intermediate size"  # intermediate_sizes' key for the routed experts
_MIXTRAL_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.")
_MIXTRAL_PROJECTIONS = {"1": "gate_proj", "2": "down_proj", "3": "up_proj"}
# Granite MoE's checkpoint names (and transformers' own for them) -> the stacked experts' and
# the router's
_GRANITE_MOE_NAMES = {".block_sparse_moe.input_linear.weight": ".mlp.experts.gate_up_proj",
                      ".block_sparse_moe.output_linear.weight": ".mlp.experts.down_proj",
                      ".block_sparse_moe.router.layer.weight": ".mlp.gate.weight",
                      ".block_sparse_moe.experts.": ".mlp.experts.",
                      ".block_sparse_moe.router.weight": ".mlp.gate.weight",
                      ".shared_mlp.input_linear.": ".mlp.shared_expert.gate_up_proj.",
                      ".shared_mlp.output_linear.": ".mlp.shared_expert.down_proj."}


def is_moe(config) -> bool:
    return config.model_type in MOE_MODEL_TYPES


def num_experts_of(config) -> int:
    """The routed experts a layer holds (Granite MoE's config names them local only;
    Hunyuan's may list them per layer: ``_per_layer``)."""
    num = getattr(config, "num_experts", None)
    return config.num_local_experts if num is None else _per_layer(config, "num_experts", num)


def top_k_of(config) -> int:
    """The experts each token takes (Hunyuan's ``moe_topk``, possibly per layer)."""
    if config.model_type == "hunyuan_v1_moe":
        return _per_layer(config, "moe_topk", config.moe_topk)
    return config.num_experts_per_tok


def _per_layer(config, field: str, value) -> int:
    """A count a config may give once or per layer (Hunyuan's): per layer, only the same for
    every layer is implemented."""
    if not isinstance(value, (list, tuple)):
        return value
    if len(set(value)) != 1:
        raise ValueError(f"{config.model_type}: {field}={list(value)} (a different count per "
                         f"layer) is not implemented")
    return value[0]


def check_moe_config(config) -> None:
    """Refuse, by name, what a MoE family's ``config`` asks for that is not computed here."""
    model_type = config.model_type
    if model_type == "glm4_moe":
        _check_groups(config)
    if model_type == "ernie4_5_moe" and config.use_bias:
        raise ValueError("ernie4_5_moe: use_bias (biases on the dense and shared MLPs beside "
                         "unbiased experts) is not implemented")
    for field, defaults in ({} if model_type in _SCORED else _OTHER_ROUTING).items():
        value = getattr(config, field, None)
        if value not in defaults:
            raise ValueError(f"{model_type}: {field}={value!r} is not implemented (it changes "
                             f"how tokens are routed, which {model_type} does not)")
    num_experts, top_k = num_experts_of(config), top_k_of(config)
    if model_type in _EVERY_LAYER and num_experts < 1:
        raise ValueError(f"{model_type}: num_experts={num_experts} must be positive")
    if num_experts > 0 and not 1 <= top_k <= num_experts:  # (none: every layer dense)
        raise ValueError(f"{model_type}: num_experts_per_tok={top_k} must be between 1 and "
                         f"num_experts={num_experts}")
    step = getattr(config, "decoder_sparse_step", 1)
    if model_type not in _EVERY_LAYER and not (isinstance(step, int) and step >= 1):
        raise ValueError(f"{model_type}: decoder_sparse_step={step!r} must be a positive "
                         f"integer")
    shared = getattr(config, "shared_expert_intermediate_size", None)
    if model_type == "qwen2_moe" and not (isinstance(shared, int) and shared > 0):
        raise ValueError(f"qwen2_moe: shared_expert_intermediate_size={shared!r} must be "
                         f"positive")
    shared = getattr(config, "shared_intermediate_size", 0)
    if model_type == "granitemoeshared" and not (isinstance(shared, int) and shared >= 0):
        raise ValueError(f"granitemoeshared: shared_intermediate_size={shared!r} must be 0 "
                         f"(none) or positive")
    if model_type == "olmoe":
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        if head_dim * config.num_attention_heads != config.hidden_size:
            # its q norm's weight has hidden_size features, one per feature of q
            raise ValueError(f"olmoe: head_dim={head_dim} times {config.num_attention_heads} "
                             f"heads must be hidden_size={config.hidden_size}")
        if getattr(config, "sliding_window", None):
            # transformers' OLMoE masks no window, yet hands it to the attention kernels (which
            # flash-attention applies and SDPA ignores): which one the model means is unclear
            raise ValueError("olmoe: sliding_window is not implemented")
        clip = getattr(config, "clip_qkv", None)
        if clip is not None and not clip > 0:
            raise ValueError(f"olmoe: clip_qkv must be positive, got {clip!r}")


def _check_groups(config) -> None:
    groups, top_groups = config.n_group or 1, config.topk_group or 1
    experts, top_k = num_experts_of(config), config.num_experts_per_tok
    if experts % groups or not 1 <= top_groups <= groups or \
            top_k > top_groups * (experts // groups) or groups > 1 and experts // groups < 2:
        raise ValueError(f"{config.model_type}: n_group={groups} and topk_group={top_groups} "
                         f"do not choose {top_k} of {experts} experts (groups of at least two "
                         f"that divide them, enough of them chosen)")


def moe_specs(config) -> list[MoeSpec | None]:
    """Each decoder layer's routed experts (None: the layer keeps a dense MLP)."""
    num_layers = config.num_hidden_layers
    if not is_moe(config):
        return [None] * num_layers
    check_moe_config(config)
    model_type = config.model_type
    if model_type in _EVERY_LAYER:
        routed = [True] * num_layers
        size = config.intermediate_size
    elif model_type == "glm4_moe":
        routed = [layer >= config.first_k_dense_replace for layer in range(num_layers)]
        size = config.moe_intermediate_size
    elif model_type == "ernie4_5_moe":
        first, last = config.moe_layer_start_index, config.moe_layer_end_index
        routed = [(layer + 1) % config.moe_layer_interval == 0 and first <= layer <= last
                  for layer in range(num_layers)]
        size = config.moe_intermediate_size
    else:
        dense = set(getattr(config, "mlp_only_layers", None) or ())
        step = getattr(config, "decoder_sparse_step", 1)
        routed = [layer not in dense and num_experts_of(config) > 0 and (layer + 1) % step == 0
                  for layer in range(num_layers)]
        size = config.moe_intermediate_size
    spec = MoeSpec(
        num_experts=num_experts_of(config), top_k=top_k_of(config),
        intermediate_size=size,
        renormalize=model_type in _RENORMALIZED or bool(getattr(config, "norm_topk_prob", False)),
        biased=model_type == "gpt_oss", **_shared_expert(config), **_scored_routing(config))
    return [spec if is_routed else None for is_routed in routed]


def _shared_expert(config) -> dict:
    """MoeSpec's fields for the family's shared expert (none: its defaults)."""
    if config.model_type == "qwen2_moe":
        return {"shared_intermediate_size": config.shared_expert_intermediate_size}
    if config.model_type == "granitemoeshared" and config.shared_intermediate_size:
        return {"shared_intermediate_size": config.shared_intermediate_size,
                "shared_gated": False}
    if config.model_type == "hunyuan_v1_moe":  # (its shared MLP, of the dense MLP's size)
        return {"shared_intermediate_size": config.intermediate_size, "shared_gated": False}
    shared = getattr(config, "n_shared_experts", None) or \
        getattr(config, "moe_num_shared_experts", None)
    if config.model_type in _SCORED and shared:
        return {"shared_intermediate_size": config.moe_intermediate_size * shared,
                "shared_gated": False}
    return {}


def _scored_routing(config) -> dict:
    """MoeSpec's fields for a routing by scores and a bias, or a router in fp32 (none: the
    softmax's defaults)."""
    if config.model_type == "hunyuan_v1_moe":
        return {"fp32_router": True}
    if config.model_type == "glm4_moe":  # DeepSeek's
        return {"scoring": "sigmoid", "score_bias": True, "num_groups": config.n_group or 1,
                "top_groups": config.topk_group or 1,
                "scale": float(config.routed_scaling_factor)}
    if config.model_type == "ernie4_5_moe":
        return {"score_bias": True, "norm_min": config.moe_norm_min}
    return {}


def shared_expert_size(config) -> int | None:
    """The intermediate size of the layers' shared expert, or None without one."""
    return next((spec.shared_intermediate_size for spec in moe_specs(config)
                 if spec is not None), None)


def intermediate_size_of(config) -> int:
    """The dense MLP's intermediate size (OPT calls it ``ffn_dim``, GPT-2's ``n_inner``, Falcon
    ``ffn_hidden_size``, by default four times the hidden size; DistilBERT ``hidden_dim``)."""
    size = getattr(config, "intermediate_size", None)
    if size is not None:
        return size
    if config.model_type in ("gpt2", "gpt_bigcode"):
        return config.n_inner or 4 * config.hidden_size
    if config.model_type == "falcon":
        return config.ffn_hidden_size or 4 * config.hidden_size
    if config.model_type == "distilbert":
        return config.hidden_dim
    return config.ffn_dim


def intermediate_sizes(config) -> dict[str, int]:
    """The intermediate sizes of the model's MLPs, by what a message calls them: the dense
    MLP's (where a layer has one), the routed experts' and the shared expert's."""
    specs = moe_specs(config)
    sizes = {}
    if any(spec is None for spec in specs):
        sizes["MLP intermediate size"] = intermediate_size_of(config)
    routed = next((spec for spec in specs if spec is not None), None)
    if routed is not None:
        sizes[EXPERTS_SIZE] = routed.intermediate_size
        if routed.shared_intermediate_size is not None:
            sizes["shared expert's intermediate size"] = routed.shared_intermediate_size
    return sizes


def gpt_oss_tensor(name: str, tensor):
    """A GPT-OSS checkpoint's tensor (under ``checkpoint_name``'s name), its stacked experts as
    the other families' stacked experts are held: gate_up [E, H, 2I] (gate and up features
    interleaved) as [E, 2I, H], the gate rows first; its bias [E, 2I] likewise; down
    [E, I, H] as [E, H, I]. (Experts in MXFP4 come apart already: ``mxfp4``.)"""
    stacked, interleaved = name.endswith(_GPT_OSS_STACKED), name.endswith(_GPT_OSS_INTERLEAVED)
    if not (stacked or interleaved):
        return tensor
    tensor = tensor[:]  # (a safetensors slice: all of it)
    if stacked:
        tensor = tensor.transpose(1, 2)
    if interleaved:
        tensor = torch.cat((tensor[:, 0::2], tensor[:, 1::2]), 1)
    return tensor.contiguous()


def experts_as_held(config, tensors):
    """A checkpoint's (name, tensor) pairs with GPT-OSS's stacked experts in the layout the
    others' are held in, under their own names (``gpt_oss_tensor``): what ``--quantization``
    splits per expert before the model reads the names."""
    for name, tensor in tensors:
        yield name, gpt_oss_tensor(name, tensor) if config.model_type == "gpt_oss" and \
            name.endswith(_GPT_OSS_STACKED) else tensor


def checkpoint_name(config, name: str) -> str:
    """A checkpoint tensor's name as the model loads it: Mixtral's MoE block and experts
    under the names the other families use (``mlp``, ``gate_proj``, ``up_proj``,
    ``down_proj``), Granite MoE's stacked experts and router under the stacked names,
    GLM-4.5's shared experts and router bias under the block's."""
    if config.model_type in _GRANITE_MOE:
        for fragment, ours in _GRANITE_MOE_NAMES.items():
            name = name.replace(fragment, ours)
        return name
    if config.model_type == "hunyuan_v1_moe":
        return name.replace(".mlp.gate.wg.", ".mlp.gate.").replace(".mlp.shared_mlp.",
                                                                    ".mlp.shared_expert.")
    if config.model_type in _SCORED:
        return name.replace(".mlp.shared_experts.", ".mlp.shared_expert.") \
            .replace(".mlp.gate.e_score_correction_bias", ".mlp.score_bias") \
            .replace(".mlp.moe_statics.e_score_correction_bias", ".mlp.score_bias")
    if config.model_type == "gpt_oss":  # (a GGUF file's experts' biases come one a projection)
        for theirs, ours in _GPT_OSS_NAMES.items():
            name = name.replace(theirs, ours)
        return name
    if config.model_type != "mixtral":
        return name
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return _MIXTRAL_EXPERT.sub(lambda m: f".experts.{m.group(1)}."
                                         f"{_MIXTRAL_PROJECTIONS[m.group(2)]}.", name)
