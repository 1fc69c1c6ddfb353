"""A PEFT adapter read for the engine's merged layers gives, per layer, the deltas PEFT's own
modules add (q, k and v as one qkv delta; gate and up as one), with PEFT's scaling (alpha / r,
rsLoRA, per-module alpha); what the engine does not compute, or what does not fit the base
model, is refused naming it."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_adapters import ALL_TARGETS, make_adapter

from actorlm import LoRARequest
from actorlm.models import lora_adapter
from actorlm.models.families import layer_specs
from actorlm.models.loader import load_hf_config
from actorlm.models.lora_adapter import (CONFIG_FILE, WEIGHTS_FILE, LoRAAdapterError,
                                         LoRAChecker, load_lora_adapter)
from actorlm.models.lora_slots import LoRAShard, LoRAState, LoRAWeights

def peft_delta(peft_model, layer: int, module: str, x: torch.Tensor) -> torch.Tensor:
    """What PEFT's module adds to its base layer's output for x."""
    block = "self_attn" if module in ALL_TARGETS[:4] else "mlp"
    lora_layer = getattr(getattr(peft_model.base_model.model.model.layers[layer], block), module)
    with torch.no_grad():
        return lora_layer(x) - lora_layer.base_layer(x)


def ours(adapter, layer, merged, x):
    m = adapter.modules[(layer, merged)]
    return x @ m.a.T @ m.b.T


@pytest.fixture(scope="module")
def specs(tiny_llama_dir):
    return layer_specs(load_hf_config(tiny_llama_dir))


@pytest.mark.parametrize("config", [{}, {"use_rslora": True},
                                    {"rank_pattern": {"v_proj": 2}, "alpha_pattern": {"o_proj": 3}}],
                         ids=["alpha-over-r", "rslora", "patterns"])
def test_merged_deltas_are_peft_deltas(tiny_llama_dir, specs, tmp_path, config):
    peft_model = make_adapter(tiny_llama_dir, tmp_path, seed=0, **config)
    adapter = load_lora_adapter("a", tmp_path, specs, max_lora_rank=16)
    assert sorted(adapter.modules) == [(layer, name) for layer in range(len(specs))
                                       for name in ("down_proj", "gate_up_proj", "o_proj",
                                                    "qkv_proj")]
    s = specs[0]
    q, kv, inter = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
    torch.manual_seed(1)
    for layer in range(len(specs)):
        x, x_o, x_down = (torch.randn(3, n) for n in (s.hidden_size, q, inter))
        qkv = ours(adapter, layer, "qkv_proj", x)
        expected = [peft_delta(peft_model, layer, m, x) for m in ("q_proj", "k_proj", "v_proj")]
        assert torch.allclose(qkv, torch.cat(expected, dim=1), atol=1e-5)
        gate_up = ours(adapter, layer, "gate_up_proj", x)
        expected = [peft_delta(peft_model, layer, m, x) for m in ("gate_proj", "up_proj")]
        assert torch.allclose(gate_up, torch.cat(expected, dim=1), atol=1e-5)
        assert torch.allclose(ours(adapter, layer, "o_proj", x_o),
                              peft_delta(peft_model, layer, "o_proj", x_o), atol=1e-5)
        assert torch.allclose(ours(adapter, layer, "down_proj", x_down),
                              peft_delta(peft_model, layer, "down_proj", x_down), atol=1e-5)
        assert qkv.shape == (3, q + 2 * kv) and qkv.abs().max() > 1e-3


def test_a_part_without_an_adapter_adds_nothing_to_its_rows(tiny_llama_dir, specs, tmp_path):
    make_adapter(tiny_llama_dir, tmp_path, seed=2, target_modules=["q_proj", "v_proj"],
                 layers_to_transform=[1])
    adapter = load_lora_adapter("a", tmp_path, specs, max_lora_rank=16)
    assert sorted(adapter.modules) == [(1, "qkv_proj")]
    s = specs[1]
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    delta = ours(adapter, 1, "qkv_proj", torch.randn(2, s.hidden_size))
    assert delta[:, q:q + kv].abs().max() == 0  # k: no adapter
    assert delta[:, :q].abs().max() > 0 and delta[:, q + kv:].abs().max() > 0
    assert adapter.modules[(1, "qkv_proj")].part_ranks == (4, 0, 4)


def test_a_slot_holds_each_parts_adapter_at_its_share_of_the_rank(tiny_llama_dir, specs,
                                                                  tmp_path):
    """A merged layer's slot gives each part max_lora_rank columns (B transposed, zero off its
    part's rows): the slot's delta is the adapter's, whatever rank each part has."""
    make_adapter(tiny_llama_dir, tmp_path, seed=5, target_modules=["q_proj", "v_proj"],
                 rank_pattern={"v_proj": 2})
    module = load_lora_adapter("a", tmp_path, specs, max_lora_rank=8).modules[(0, "qkv_proj")]
    assert module.part_ranks == (4, 0, 2)
    s = specs[0]
    q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    weights = LoRAWeights(LoRAState(), None, 3, 8, s.hidden_size, (q, kv, kv),
                          LoRAShard((0, q, q + kv), (0, s.hidden_size)), torch.float32, "cpu")
    weights.load(1, module)
    a, b, parts = weights.table
    assert a.shape == (3, 24, s.hidden_size) and b.shape == (3, 24, q + 2 * kv)
    x = torch.randn(2, s.hidden_size)
    assert torch.allclose(x @ a[1].T @ b[1], x @ module.a.T @ module.b.T, atol=1e-5)
    for p, rows in enumerate(((0, q), (q, q + kv), (q + kv, q + 2 * kv))):  # block-diagonal
        off = torch.ones(24, dtype=torch.bool)
        off[8 * p:8 * (p + 1)] = False
        assert b[1, off, rows[0]:rows[1]].abs().max() == 0
    assert a[0].abs().max() == 0 and b[2].abs().max() == 0  # the other slots stay empty
    weights.load(1, None)
    assert a.abs().max() == 0 and b.abs().max() == 0


def test_the_checker_reads_an_adapter_off_the_callers_thread(specs, monkeypatch):
    """Torch work on the frontend's thread would give it an OpenMP pool for good (see
    actorlm.openmp): the checker reads on a passing thread."""
    readers = []
    monkeypatch.setattr(lora_adapter, "load_lora_adapter",
                        lambda *args: readers.append(threading.current_thread()))
    LoRAChecker(specs, 16).check(LoRARequest("a", 1, "/nowhere"))
    assert readers and readers[0] is not threading.current_thread()


def _corrupt(path, config=None, tensors=None):
    if config is not None:
        (path / CONFIG_FILE).write_text(json.dumps({**json.loads((path / CONFIG_FILE)
                                                                 .read_text()), **config}))
    if tensors is not None:
        weights = load_file(path / WEIGHTS_FILE)
        save_file(tensors(weights), path / WEIGHTS_FILE)


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p / CONFIG_FILE).unlink(), "no adapter_config.json"),
    (lambda p: (p / WEIGHTS_FILE).unlink(), "no adapter_model.safetensors"),
    (lambda p: (p / WEIGHTS_FILE).write_bytes(b"not tensors"), "not a safetensors file"),
    (lambda p: (p / CONFIG_FILE).write_text("{"), "not JSON"),
    (lambda p: _corrupt(p, {"use_dora": True}), "DoRA"),
    (lambda p: _corrupt(p, {"bias": "all"}), "bias 'all'"),
    (lambda p: _corrupt(p, {"modules_to_save": ["lm_head"]}), "modules_to_save"),
    (lambda p: _corrupt(p, {"r": 0}), "r must be a positive number"),
    (lambda p: _corrupt(p, tensors=lambda w: {k.replace("layers.1.", "layers.7."): v
                                              for k, v in w.items()}), "has 2 layers"),
    (lambda p: _corrupt(p, tensors=lambda w: {k: v[:, :-1].contiguous() if "q_proj.lora_A" in k else v
                                              for k, v in w.items()}), "do not fit"),
    (lambda p: _corrupt(p, tensors=lambda w: {k: v for k, v in w.items()
                                              if "k_proj.lora_B" not in k}), "in pairs"),
    (lambda p: _corrupt(p, tensors=lambda w: {**w, "base_model.model.lm_head.lora_A.weight":
                                              torch.zeros(4, 64)}), "no LoRA weight of"),
], ids=["no-config", "no-weights", "bad-weights", "bad-json", "dora", "bias", "modules-to-save",
        "rank-zero", "layer-beyond", "wrong-shape", "lone-half", "lm-head"])
def test_what_does_not_fit_is_refused_by_name(tiny_llama_dir, specs, tmp_path, damage, message):
    make_adapter(tiny_llama_dir, tmp_path, seed=3)
    damage(tmp_path)
    with pytest.raises(LoRAAdapterError, match=message):
        load_lora_adapter("a", tmp_path, specs, max_lora_rank=16)


def test_a_rank_over_the_limit_is_refused(tiny_llama_dir, specs, tmp_path):
    make_adapter(tiny_llama_dir, tmp_path, seed=4, r=8)
    with pytest.raises(LoRAAdapterError, match="rank 8 exceeds --max-lora-rank 4"):
        load_lora_adapter("a", tmp_path, specs, max_lora_rank=4)


def test_no_directory_is_refused(specs, tmp_path):
    with pytest.raises(LoRAAdapterError, match="no such adapter directory"):
        load_lora_adapter("a", tmp_path / "missing", specs, max_lora_rank=16)
