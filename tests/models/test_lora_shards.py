"""Each tensor-parallel rank's LoRA slots hold its share of an adapter as of its base layers:
a column-parallel layer's delta is the whole delta's columns of the rank's outputs (q, k and v
heads; its halves of gate and up), a row-parallel layer's deltas over the ranks' inputs sum to
the whole delta; with fewer KV heads than ranks, each rank holds the k and v of the head it
reads."""

from __future__ import annotations

import pytest
import torch
from checkpoints import _common
from lora_adapters import make_adapter

from actorlm.kernels import select_backend
from actorlm.models.causal_lm import CausalLM
from actorlm.models.families import layer_specs
from actorlm.models.lora_adapter import load_lora_adapter
from actorlm.models.lora_slots import LoRASlots
from actorlm.models.parallel import TensorParallel

TP = 2


def _config(tiny_tokenizer_dir, num_kv_heads):
    from transformers import LlamaConfig

    return LlamaConfig(**{**_common(tiny_tokenizer_dir), "num_key_value_heads": num_kv_heads},
                       rope_theta=10000.0)


def _rank_tables(config, module_of, rank):
    """Rank ``rank``'s slot 0 tables (layer name -> (a, b)) holding the adapter."""
    model = CausalLM(config, select_backend("cpu"), torch.float32, tp=TensorParallel(rank, TP))
    slots = LoRASlots(model, max_loras=1, max_lora_rank=16, max_cpu_loras=None)
    tables = {}
    for (layer, name), weights in slots.layers.items():
        if layer == 0:
            weights.load(0, module_of[name])
            tables[name] = (weights.table.a[0], weights.table.b[0])
    return model, tables


@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["kv-split", "kv-replicated"])
def test_each_rank_holds_its_share_of_an_adapter(tiny_tokenizer_dir, tmp_path, num_kv_heads):
    config = _config(tiny_tokenizer_dir, num_kv_heads)
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model"
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    make_adapter(model_dir, tmp_path / "adapter", seed=3, r=4)
    specs = layer_specs(config)
    adapter = load_lora_adapter("a", tmp_path / "adapter", specs, max_lora_rank=16)
    module_of = {name: adapter.modules[(0, name)]
                 for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    s = specs[0]
    d, q, kv = s.head_dim, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    inter = s.intermediate_size
    torch.manual_seed(0)
    x, x_o, x_down = (torch.randn(3, n) for n in (s.hidden_size, q, inter))

    def whole(name, inputs):
        m = module_of[name]
        return inputs @ m.a.T @ m.b.T

    o_sum, down_sum = 0, 0
    for rank in range(TP):
        model, tables = _rank_tables(config, module_of, rank)
        attn = model.model.layers[0].self_attn
        # this rank's q heads, and the KV head(s) they read
        q_rows = list(range(rank * attn.q_size, (rank + 1) * attn.q_size))
        kv_first = rank * attn.num_heads * s.num_kv_heads // s.num_heads * d
        kv_rows = list(range(kv_first, kv_first + attn.kv_size))
        rows = q_rows + [q + r for r in kv_rows] + [q + kv + r for r in kv_rows]
        a, b = tables["qkv_proj"]
        assert torch.allclose(x @ a.T @ b, whole("qkv_proj", x)[:, rows], atol=1e-5)
        half = inter // TP
        a, b = tables["gate_up_proj"]
        gate_up_rows = list(range(rank * half, (rank + 1) * half))
        gate_up_rows += [inter + r for r in gate_up_rows]
        assert torch.allclose(x @ a.T @ b, whole("gate_up_proj", x)[:, gate_up_rows], atol=1e-5)
        a, b = tables["o_proj"]
        o_sum = o_sum + x_o[:, rank * attn.q_size:(rank + 1) * attn.q_size] @ a.T @ b
        a, b = tables["down_proj"]
        down_sum = down_sum + x_down[:, rank * half:(rank + 1) * half] @ a.T @ b
    assert torch.allclose(o_sum, whole("o_proj", x_o), atol=1e-5)
    assert torch.allclose(down_sum, whole("down_proj", x_down), atol=1e-5)
