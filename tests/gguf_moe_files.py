"""Tiny mixture-of-experts GGUF files, laid out as llama.cpp's converter writes them: each
layer's experts stacked into one 3-D tensor per projection (``ffn_gate_exps``, ``ffn_up_exps``
[E, I, H] and ``ffn_down_exps`` [E, H, I] in torch order), the router ``ffn_gate_inp`` and
Qwen2-MoE's shared-expert gate ``ffn_gate_inp_shexp`` (squeezed to [H]) kept in F32, as
llama.cpp keeps them, and every other matrix in one block format. Mixtral's file says
architecture ``llama`` (its q and k rows permuted), OLMoE's ``olmoe``, Granite MoE's
``granitemoe`` (q and k permuted, its stacked gate/up split in two, its scales as Granite's),
GLM-4.5's ``glm4moe`` (its routing bias ``exp_probs_b``, DeepSeek's routing in the metadata),
ERNIE 4.5's ``ernie4_5-moe`` (its routing bias as ``exp_probs_b`` too).

The checkpoints here (``save_routed``) route every layer, as llama.cpp's MoE graphs do (GLM-4.5's
but its first, dense as ``leading_dense_block_count`` says).
"""

from __future__ import annotations

import json
import pathlib

import numpy as np
import torch
from gguf_files import (K_TYPES, _permute, _write_config, _write_tokenizer,
                        dequantized_checkpoint, random_blocks)

ARCHITECTURES = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama",
                 "olmoe": "olmoe", "granitemoe": "granitemoe", "glm4_moe": "glm4moe",
                 "ernie4_5_moe": "ernie4_5-moe"}
_PERMUTED = ("mixtral", "granitemoe")  # q and k rows permuted, as a Llama's
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate": "ffn_gate_inp", "mlp.router.layer": "ffn_gate_inp",
          "mlp.output_linear": "ffn_down_exps", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          # GLM-4.5's: its dense layers' MLP, shared experts, and the norm before its MLP
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
          "mlp.shared_experts.up_proj": "ffn_up_shexp",
          "mlp.shared_experts.down_proj": "ffn_down_shexp"}
_GLM4_MOE = {"post_attention_layernorm": "post_attention_norm"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# llama.cpp never quantizes the routers (nor their biases)
_KEPT_IN_F32 = ("ffn_gate_inp", "ffn_gate_inp_shexp", "exp_probs_b")
_SEEDS = {"mixtral": 40, "olmoe": 41, "qwen2_moe": 42, "qwen3_moe": 43, "qwen3_moe_k": 44,
          "granitemoe": 45, "glm4_moe": 46, "ernie4_5_moe": 47}


def moe_state(hf_dir: pathlib.Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(the config, every tensor under its GGUF name, the experts stacked, fp32 numpy)."""
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    state = {}
    for file in sorted(hf_dir.glob("*.safetensors")):
        state.update(load_file(file))
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    tensors, experts = {}, {}  # experts: (layer, projection) -> {expert: values}
    for name, tensor in state.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        for ours, theirs in _MIXTRAL.items():
            name = name.replace(f".{ours}.", f".{theirs}.")
        values = tensor.float().numpy()
        stem, _, kind = name.rpartition(".")
        if not stem.startswith("model.layers."):
            tensors[f"{_TOP[stem]}.{kind}"] = values
            continue
        _, _, layer, part = stem.split(".", 3)
        if part.startswith("mlp.experts."):
            _, _, expert, projection = part.split(".")
            experts.setdefault((layer, projection), {})[int(expert)] = values
            continue
        if part == "mlp.input_linear":  # Granite MoE's experts stacked: gate rows, then up
            for projection, half in zip(("gate_proj", "up_proj"), np.split(values, 2, axis=1)):
                tensors[f"blk.{layer}.{_EXPERTS[projection]}.weight"] = half
            continue
        if config["model_type"] in _PERMUTED and part in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = config["num_attention_heads"] if "q_proj" in part else \
                config["num_key_value_heads"]
            values = _permute(values, heads)
        if part == "mlp.shared_expert_gate":
            values = values.reshape(-1)  # [1, H] -> [H], as llama.cpp's converter squeezes it
        if kind == "e_score_correction_bias":  # (GLM-4.5's, ERNIE's [1, E])
            tensors[f"blk.{layer}.exp_probs_b.bias"] = values
            continue
        names = {**_LAYER, **_GLM4_MOE} if config["model_type"] == "glm4_moe" else _LAYER
        tensors[f"blk.{layer}.{names[part]}.{kind}"] = values
    for (layer, projection), by_expert in experts.items():
        tensors[f"blk.{layer}.{_EXPERTS[projection]}.weight"] = np.stack(
            [by_expert[e] for e in range(len(by_expert))])
    return config, tensors


def write_moe_gguf(hf_dir: pathlib.Path, out: pathlib.Path, type_name: str,
                   draft_layer: bool = False) -> pathlib.Path:
    """The MoE checkpoint ``hf_dir`` as a GGUF file whose matrices (but the routers) are
    ``type_name`` blocks (or F32); a K format gets random valid blocks
    (``gguf_files.random_blocks``), which the oracle then reads back dequantized. With
    ``draft_layer`` (GLM-4.5's), a multi-token-prediction layer after the others, counted in
    ``block_count``: a copy of the last layer and the ``nextn`` tensors. Returns the file."""
    import gguf

    config, tensors = moe_state(hf_dir)
    if draft_layer:
        last, draft = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
        tensors.update({name.replace(f"blk.{last}.", f"blk.{draft}."): values
                        for name, values in list(tensors.items())
                        if name.startswith(f"blk.{last}.")})
        tensors[f"blk.{draft}.nextn.eh_proj.weight"] = np.zeros(
            (config["hidden_size"], 2 * config["hidden_size"]), np.float32)
        config = {**config, "num_hidden_layers": draft + 1, "num_nextn_predict_layers": 1}
    else:  # (a config may say it has one: the checkpoint here has none)
        config = {**config, "num_nextn_predict_layers": 0}
    writer = gguf.GGUFWriter(out, ARCHITECTURES[config["model_type"]])
    _write_moe_config(writer, config)
    _write_tokenizer(writer, hf_dir)
    kind = gguf.GGMLQuantizationType[type_name]
    for seed, (name, values) in enumerate(sorted(tensors.items())):
        if values.ndim == 1 or type_name == "F32" or name.rsplit(".", 2)[-2] in _KEPT_IN_F32:
            writer.add_tensor(name, values)
        elif type_name in K_TYPES:
            rows = random_blocks(type_name, int(np.prod(values.shape[:-1])), values.shape[-1],
                                 seed)
            writer.add_tensor(name, rows.reshape(*values.shape[:-1], -1), raw_dtype=kind)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _write_moe_config(writer, config: dict) -> None:
    import gguf

    model_type = config["model_type"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    _write_config(writer, {**config, "head_dim": head_dim})  # (the dense keys)
    writer.add_expert_count(next(config[key] for key in (
        "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
        if config.get(key)))
    writer.add_expert_used_count(config.get("num_experts_per_tok") or config["moe_k"])
    if model_type in ("qwen3_moe", "qwen2_moe"):
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    if model_type == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    if config.get("clip_qkv") is not None:
        writer.add_clamp_kqv(config["clip_qkv"])
    if model_type == "glm4_moe":  # (DeepSeek's routing, as llama.cpp's converter writes it)
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_count(config["n_shared_experts"])
        writer.add_leading_dense_block_count(config["first_k_dense_replace"])
        writer.add_expert_weights_scale(config["routed_scaling_factor"])
        writer.add_expert_weights_norm(config["norm_topk_prob"])
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_group_count(config["n_group"])
        writer.add_expert_group_used_count(config["topk_group"])
        writer.add_nextn_predict_layers(config.get("num_nextn_predict_layers", 0))
    if model_type == "ernie4_5_moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_count(config["moe_num_shared_experts"])
        writer.add_leading_dense_block_count(config["moe_layer_start_index"])
        writer.add_interleave_moe_layer_step(config["moe_layer_interval"])


def dequantized_moe(hf_dir: pathlib.Path, type_name: str):
    """``dequantized_checkpoint`` of a checkpoint whose routers the file keeps in F32: the
    oracle of the blocks, for the families whose GGUF files transformers does not read
    (Mixtral, OLMoE)."""
    return dequantized_checkpoint(hf_dir, type_name,
                                  kept=(".gate.weight", "shared_expert_gate.weight",
                                        ".router.weight"))


def save_routed(tmp_path_factory, tokenizer_dir, family: str) -> pathlib.Path:
    """A tiny checkpoint of ``family`` (or ``qwen3_moe_k``: hidden 256, for the K formats)
    with every layer routed, 8 experts, top 2 (``checkpoints._save_tiny``). The Qwen families'
    experts have 64 features, so that 2 tensor-parallel ranks split their down projections on
    32-value blocks; Mixtral's and OLMoE's 32, which 2 ranks can split only as whole experts."""
    from checkpoints import _common, _save_tiny
    from transformers import (Ernie4_5_MoeConfig, Glm4MoeConfig, GraniteMoeConfig,
                              MixtralConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig)

    common = {**_common(tokenizer_dir), "num_hidden_layers": 2}
    experts = dict(num_experts_per_tok=2, router_aux_loss_coef=0.0, tie_word_embeddings=False)
    configs = {
        "qwen3_moe": lambda: Qwen3MoeConfig(**common, **experts, num_experts=8,
                                            moe_intermediate_size=64, norm_topk_prob=True),
        "qwen2_moe": lambda: Qwen2MoeConfig(**common, **experts, num_experts=8,
                                            moe_intermediate_size=64,
                                            shared_expert_intermediate_size=64,
                                            norm_topk_prob=False),
        "mixtral": lambda: MixtralConfig(**{**common, "intermediate_size": 32}, **experts,
                                         num_local_experts=8),
        "olmoe": lambda: OlmoeConfig(**{**{k: v for k, v in common.items() if k != "head_dim"},
                                        "intermediate_size": 32, "num_key_value_heads": 1},
                                     **experts, num_experts=8, clip_qkv=4.0),
        "granitemoe": lambda: GraniteMoeConfig(
            **{**common, "intermediate_size": 32}, **experts, num_local_experts=8,
            embedding_multiplier=12.0, attention_multiplier=0.2, residual_multiplier=0.22,
            logits_scaling=8.0),
        "glm4_moe": lambda: Glm4MoeConfig(
            **common, **experts, n_routed_experts=8, n_shared_experts=1,
            moe_intermediate_size=64, n_group=2, topk_group=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
            attention_bias=True),
        "ernie4_5_moe": lambda: Ernie4_5_MoeConfig(
            **common, **experts, moe_num_experts=8, moe_intermediate_size=64,
            moe_num_shared_experts=1, moe_layer_start_index=1),
        "qwen3_moe_k": lambda: Qwen3MoeConfig(
            **{**common, "hidden_size": 256, "head_dim": 64, "initializer_range": 0.1},
            **experts, num_experts=8, moe_intermediate_size=256, norm_topk_prob=True),
    }
    return _save_tiny(tmp_path_factory, tokenizer_dir, f"tiny_routed_{family}",
                      configs[family](), seed=_SEEDS[family])


def transformers_on_gguf(gguf_path: pathlib.Path):
    """transformers reading the file itself (dequantized, fp32) with the config the engine
    builds from it: transformers' own config of a qwen2moe / qwen3moe file keeps its class's
    default expert sizes (it does not read ``expert_feed_forward_length``)."""
    from transformers import AutoModelForCausalLM

    from actorlm.models.loader import load_hf_config, resolve_model

    return AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, config=load_hf_config(resolve_model(gguf_path)),
        dtype=torch.float32, local_files_only=True).eval()


def write_gpt_oss_gguf(hf_dir: pathlib.Path, out: pathlib.Path,
                       experts_in: str = "MXFP4") -> tuple[pathlib.Path, dict]:
    """The GPT-OSS checkpoint ``hf_dir`` as llama.cpp's converter writes it (``gpt-oss``): the
    experts' gate and up apart ([E, I, H] each, from the checkpoint's interleaved [E, H, 2I])
    and their biases beside them, the experts in MXFP4 blocks (``experts_in``, or F32); the
    router, sinks and the rest in F32. Returns (the file, the checkpoint's tensors with the
    experts' weights as the file holds them: transformers' oracle)."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    [file] = hf_dir.glob("*.safetensors")
    state = load_file(file)
    tensors, oracle = {}, dict(state)
    mxfp4 = gguf.GGMLQuantizationType.MXFP4
    for name, tensor in state.items():
        values = tensor.float().numpy()
        stem, _, kind = name.rpartition(".")
        if not stem.startswith("model.layers."):
            tensors[f"{_TOP[stem]}.{kind}"] = values
            continue
        layer, part = stem.split(".", 3)[2:]
        projection = name.split(".", 3)[3].removeprefix("mlp.experts.")  # (no .weight)
        if projection in ("gate_up_proj", "down_proj"):  # [E, in, out] -> [E, out, in] blocks
            rows = np.ascontiguousarray(np.swapaxes(values, 1, 2))
            if experts_in == "MXFP4":
                blocks = gguf.quants.quantize(rows, mxfp4)
                # (the oracle reads the blocks' values back, in the checkpoint's layout)
                oracle[name] = torch.from_numpy(np.swapaxes(
                    gguf.quants.dequantize(blocks, mxfp4), 1, 2).copy())
            stored = (blocks, mxfp4) if experts_in == "MXFP4" else (rows, None)
            parts = {"down_proj": stored} if projection == "down_proj" else \
                {"gate_proj": (stored[0][:, 0::2], stored[1]),
                 "up_proj": (stored[0][:, 1::2], stored[1])}
            for ours, stored_part in parts.items():
                tensors[f"blk.{layer}.{_EXPERTS[ours]}.weight"] = stored_part
        elif projection in ("gate_up_proj_bias", "down_proj_bias"):
            parts = {"down_proj": values} if projection == "down_proj_bias" else \
                {"gate_proj": values[:, 0::2], "up_proj": values[:, 1::2]}
            for ours, bias in parts.items():
                tensors[f"blk.{layer}.{_EXPERTS[ours]}.bias"] = np.ascontiguousarray(bias)
        elif projection == "self_attn.sinks":
            tensors[f"blk.{layer}.attn_sinks.weight"] = values
        else:
            names = {**_LAYER, "mlp.router": "ffn_gate_inp",
                     "post_attention_layernorm": "post_attention_norm"}
            tensors[f"blk.{layer}.{names[part]}.{kind}"] = values
    writer = gguf.GGUFWriter(out, "gpt-oss")
    _write_config(writer, config)
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_sliding_window(config["sliding_window"])
    rope = config["rope_parameters"]
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    _write_tokenizer(writer, hf_dir)
    for name, values in sorted(tensors.items()):
        values, kind = values if isinstance(values, tuple) else (values, None)
        writer.add_tensor(name, np.ascontiguousarray(values), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out, oracle
