"""A checkpoint's tensors as the shared decoder loads them (``checkpoint_tensors``): a text tower's
names as a text model's (its vision tower left out), each family's names as the decoder's
(``_RENAMES``), Phi-3's, GLM's and GPT-2's fused q/k/v and gate/up split into the projections
they fuse (so that they merge and shard as every family's do), GPT-2's Conv1D weights
transposed, GPT-NeoX's, Falcon's and GPT-BigCode's q/k/v regrouped from their heads, Nemotron's
norm weights counted from 1, Mixtral's and Granite MoE's experts under the other MoE families'
names, and q and k in the order the kernels rotate them (``rope_layout``); ``narrow`` reads a
part of any tensor a checkpoint holds."""

from __future__ import annotations

import re

import torch

from actorlm.kernels import ActivationQuant, QuantizedWeight
from actorlm.models import quantized
from actorlm.models.families import (has_head_layer_norms, head_dim_of, num_kv_heads_of,
                                     qkv_groups, rope_head_order)
from actorlm.models.moe_families import (checkpoint_name, gpt_oss_tensor, intermediate_size_of,
                                         shared_expert_size)
from actorlm.models.rope_layout import ROTATED_Q_K, reordered

# GPT-2's Conv1D weights, [in, out]; the causal masks its first checkpoints hold as tensors
_GPT2_CONV1D = (".attn.c_attn.weight", ".attn.c_proj.weight", ".mlp.c_fc.weight",
                ".mlp.c_proj.weight")
_GPT2_MASKS = (".attn.bias", ".attn.masked_bias")
# buffers GPT-NeoX's first checkpoints (Pythia's) hold: its causal masks, RoPE's frequencies
_GPT_NEOX_BUFFERS = (".attention.bias", ".attention.masked_bias",
                     ".attention.rotary_emb.inv_freq")
# GPT-2's (and GPT-BigCode's) names
_GPT2_NAMES = {"transformer.wte.": "model.embed_tokens.",
               "transformer.wpe.": "model.embed_positions.",
               "transformer.ln_f.": "model.norm.", "transformer.h.": "model.layers.",
               ".ln_1.": ".input_layernorm.", ".ln_2.": ".post_attention_layernorm.",
               ".attn.c_attn.": ".self_attn.qkv_proj.",
               ".attn.c_proj.": ".self_attn.o_proj.", ".mlp.c_fc.": ".mlp.fc_in.",
               ".mlp.c_proj.": ".mlp.down_proj."}
# a family's checkpoint names -> the shared decoder's
_RENAMES = {"starcoder2": {".mlp.c_fc.": ".mlp.fc_in.", ".mlp.c_proj.": ".mlp.down_proj."},
            "phi": {".mlp.fc1.": ".mlp.fc_in.", ".mlp.fc2.": ".mlp.down_proj.",
                    ".self_attn.dense.": ".self_attn.o_proj.",
                    "model.final_layernorm.": "model.norm."},
            # (the model's last norm before the layers' own final_layer_norm)
            "opt": {"model.decoder.final_layer_norm.": "model.norm.", "model.decoder.": "model.",
                    ".self_attn.out_proj.": ".self_attn.o_proj.",
                    ".self_attn_layer_norm.": ".input_layernorm.",
                    ".final_layer_norm.": ".post_attention_layernorm.",
                    ".fc1.": ".mlp.fc_in.", ".fc2.": ".mlp.down_proj."},
            "nemotron": {".mlp.up_proj.": ".mlp.fc_in."},
            "falcon": {"transformer.word_embeddings.": "model.embed_tokens.",
                       "transformer.ln_f.": "model.norm.", "transformer.h.": "model.layers.",
                       ".self_attention.query_key_value.": ".self_attn.qkv_proj.",
                       ".self_attention.dense.": ".self_attn.o_proj.",
                       ".mlp.dense_h_to_4h.": ".mlp.fc_in.",
                       ".mlp.dense_4h_to_h.": ".mlp.down_proj.",
                       ".ln_attn.": ".input_layernorm.", ".ln_mlp.": ".post_attention_layernorm."},
            "gpt_neox": {"gpt_neox.embed_in.": "model.embed_tokens.",
                         "gpt_neox.final_layer_norm.": "model.norm.",
                         "gpt_neox.layers.": "model.layers.", "embed_out.": "lm_head.",
                         ".attention.query_key_value.": ".self_attn.qkv_proj.",
                         ".attention.dense.": ".self_attn.o_proj.",
                         ".mlp.dense_h_to_4h.": ".mlp.fc_in.",
                         ".mlp.dense_4h_to_h.": ".mlp.down_proj."},
            "arcee": {".mlp.up_proj.": ".mlp.fc_in."},
            **{hunyuan: {".self_attn.query_layernorm.": ".self_attn.q_norm.",
                         ".self_attn.key_layernorm.": ".self_attn.k_norm."}
               for hunyuan in ("hunyuan_v1_dense", "hunyuan_v1_moe")},
            "gpt2": _GPT2_NAMES, "gpt_bigcode": _GPT2_NAMES}
# a q/k LayerNorm of each head: Cohere's (q_norm, [heads, head_dim]), StableLM's (one a head,
# q_layernorm.norms.H) and Phi's (one for all heads, q_layernorm)
_HEAD_NORM = re.compile(r"\.(q|k)_(?:layernorm|norm)(?:\.norms\.(\d+))?\.(weight|bias)$")
# a gemma3 (text and vision) checkpoint's text tower -> a text model's names; both layouts
# transformers has written
_TEXT_TOWER = {"model.language_model.": "model.", "language_model.model.": "model.",
               "language_model.lm_head.": "lm_head."}
_VISION = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
           "multi_modal_projector.", "model.visual.", "visual.", "model.image_newline",
           "image_newline")


def checkpoint_tensors(config, tensors):
    """The checkpoint's (name, tensor) pairs as the model loads them: a text tower's names as
    a text model's (its vision tower left out), Phi-3's (and GLM's) fused q/k/v and gate/up
    split into the projections they fuse (so that they merge and shard as every family's
    do), Mixtral's and GPT-OSS's experts under the other MoE families' names and layout, and q
    and k in the order the kernels rotate them (``rope_layout``)."""
    q_size = config.num_attention_heads * head_dim_of(config)
    kv_size = num_kv_heads_of(config) * head_dim_of(config)
    order = rope_head_order(config)
    if has_head_layer_norms(config):
        tensors = _flat_head_norms(config, tensors)
    for name, tensor in _split_fused(config, tensors, q_size, kv_size):
        if name.endswith(".mlp.score_bias"):  # (ERNIE's is [1, E])
            tensor = narrow(tensor, 0, 0, None).reshape(-1)
        if order is not None and name.endswith(ROTATED_Q_K):
            tensor = reordered(narrow(tensor, 0, 0, None), order, head_dim_of(config))
        yield name, tensor


def _split_fused(config, tensors, q_size: int, kv_size: int):
    """The pairs under a text model's names, fused projections split."""
    for name, tensor in tensors:
        if name.startswith(_VISION) or _is_draft_weight(config, name):
            continue
        for prefix, ours in _TEXT_TOWER.items():
            if name.startswith(prefix):
                name = ours + name.removeprefix(prefix)
                break
        name = checkpoint_name(config, name)
        if config.model_type == "gpt_oss":
            tensor = gpt_oss_tensor(name, tensor)
        if config.model_type == "gpt2":
            name, tensor = _gpt2_tensor(name, tensor)
            if name is None:
                continue
        if config.model_type == "gpt_neox" and name.endswith(_GPT_NEOX_BUFFERS) or \
                config.model_type == "gpt_bigcode" and name.endswith(_GPT2_MASKS):
            continue
        if (".query_key_value." in name or ".attn.c_attn." in name) and \
                (groups := qkv_groups(config)):
            tensor = qkv_regrouped(tensor, groups, config.num_attention_heads // groups)
        for fragment, ours in _RENAMES.get(config.model_type, {}).items():
            name = name.replace(fragment, ours)
        if config.model_type == "nemotron" and name.endswith("norm.weight"):
            # LayerNorm1P's weight + 1, in fp32: the model's dtype then rounds it once, as
            # transformers' add in that dtype does
            tensor = narrow(tensor, 0, 0, None).float() + 1
        if ".self_attn.qkv_proj." in name:
            parts = [("q_proj", 0, q_size), ("k_proj", q_size, kv_size),
                     ("v_proj", q_size + kv_size, kv_size)]
        elif ".mlp.gate_up_proj." in name or ".mlp.shared_expert.gate_up_proj." in name:
            half = shared_expert_size(config) if ".shared_expert." in name else \
                intermediate_size_of(config)
            parts = [("gate_proj", 0, half), ("up_proj", half, half)]
        else:
            yield name, tensor
            continue
        fused = name.split(".")[-2]
        for part, start, length in parts:
            yield name.replace(f".{fused}.", f".{part}."), narrow(tensor, 0, start, length)


def _is_draft_weight(config, name: str) -> bool:
    """A checkpoint's multi-token-prediction weights, a draft's, which the model does not run
    (transformers ignores them too): GLM-4.5's layer ``model.layers.{N}``, N the config's
    layers or more; ERNIE 4.5's ``mtp`` tensors."""
    if config.model_type == "ernie4_5_moe":
        return "mtp" in name
    if config.model_type != "glm4_moe" or not name.startswith("model.layers."):
        return False
    return int(name.split(".", 3)[2]) >= config.num_hidden_layers


def _flat_head_norms(config, tensors):
    """The pairs with each head's q/k LayerNorms as one flat tensor, [heads x head_dim] like
    the projection's rows, under ``q_norm`` / ``k_norm``: Cohere's flattened, StableLM's
    stacked (once every head's has come), Phi's repeated over the heads."""
    heads = {"q": config.num_attention_heads, "k": num_kv_heads_of(config)}
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors:
        match = _HEAD_NORM.search(name)
        if match is None:
            yield name, tensor
            continue
        which, head, kind = match.groups()
        flat = f"{name[:match.start()]}.{which}_norm.{kind}"
        tensor = narrow(tensor, 0, 0, None)
        if head is None:
            yield flat, tensor.reshape(-1) if tensor.dim() == 2 else tensor.repeat(heads[which])
            continue
        parts = pending.setdefault(flat, {})
        parts[int(head)] = tensor
        if len(parts) == heads[which]:
            yield flat, torch.cat([parts.pop(h) for h in range(heads[which])])
            del pending[flat]
    if pending:
        raise ValueError(f"the checkpoint has the norms of some heads only: {sorted(pending)}")


def qkv_regrouped(tensor, num_groups: int, queries_per_group: int) -> torch.Tensor:
    """Fused q/k/v rows in groups, each group's ``queries_per_group`` query heads, then its key
    and value head (GPT-NeoX's, GPT-BigCode's and Falcon's: one query a group, or Falcon's new
    architecture's several), as every query head, then every key head, then every value head
    (the order the split below reads)."""
    tensor = narrow(tensor, 0, 0, None)
    if not isinstance(tensor, torch.Tensor):
        raise ValueError("a fused query_key_value in blocks is not implemented")
    grouped = tensor.reshape(num_groups, queries_per_group + 2, -1, *tensor.shape[1:])
    parts = (grouped[:, :queries_per_group], grouped[:, -2:-1], grouped[:, -1:])
    return torch.cat([part.reshape(-1, *tensor.shape[1:]) for part in parts])


def _gpt2_tensor(name: str, tensor):
    """A GPT-2 checkpoint's tensor under the ``transformer.`` prefix, a Conv1D weight as a
    Linear's [out, in]; (None, None) for a causal mask; a GGUF file's as it is (under the
    decoder's names already, its weights a Linear's)."""
    if name.endswith(_GPT2_MASKS):
        return None, None
    if name.startswith("model."):
        return name, tensor
    if not name.startswith(("transformer.", "lm_head.")):
        name = "transformer." + name
    if name.endswith(_GPT2_CONV1D):
        tensor = narrow(tensor, 0, 0, None).t().contiguous()
    return name, tensor


def narrow(tensor, dim, start, length):
    """``start:start + length`` along ``dim`` (everything when ``length`` is None) of a tensor,
    a weight in blocks, or read from a safetensors slice; an FP8 checkpoint's quantization
    of a fused layer's input, which its parts share, whole."""
    if isinstance(tensor, ActivationQuant):
        return tensor
    if isinstance(tensor, QuantizedWeight):
        return tensor if length is None else quantized.narrow(tensor, dim, start, length)
    if isinstance(tensor, torch.Tensor):
        return tensor if length is None else tensor.narrow(dim, start, length)
    if length is None:
        return tensor[:]
    return tensor[(slice(None),) * dim + (slice(start, start + length),)]
