"""KV pool sizing: the budget arithmetic, --gpu-memory-utilization, and the largest step that a
GPU engine profiles before it sizes the pool (run here on the CPU through the real runner)."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import pytest
import torch

from actorlm.api.flags import add_engine_flags, engine_flags
from actorlm.config import EngineConfig
from actorlm.kernels import select_backend
from actorlm.models.loader import load_model
from actorlm.models.memory_profile import (kv_cache_budget, largest_step, num_blocks_needed,
                                    run_dummy_step)
from actorlm.models.parts import load_model_parts
from actorlm.models.runner import ModelRunner

GIB = 1 << 30


@pytest.mark.parametrize("total,used,peak,utilization,expected", [
    (80 * GIB, 16 * GIB, 2 * GIB, 0.9, int(0.9 * 80 * GIB) - 18 * GIB),  # a 7B model in bf16
    (80 * GIB, 0, 0, 1.0, 80 * GIB),  # the whole device
    (24 * GIB, GIB, GIB // 2, 0.5, 12 * GIB - GIB - GIB // 2),
    (1000, 100, 50, 0.2, 50),
])
def test_budget_is_the_allowed_share_less_used_and_activations(total, used, peak, utilization,
                                                               expected):
    assert kv_cache_budget(total, used, peak, utilization) == expected


@pytest.mark.parametrize("used,peak", [(70 * GIB, 2 * GIB), (72 * GIB, 0), (60 * GIB, 20 * GIB)])
def test_no_memory_left_names_the_flags_to_change(used, peak):
    with pytest.raises(ValueError, match="--gpu-memory-utilization") as info:
        kv_cache_budget(80 * GIB, used, peak, 0.9)
    assert "--num-kv-blocks" in str(info.value)


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.01, 2, "0.5", True, None])
def test_gpu_memory_utilization_outside_0_1_is_refused(value):
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        EngineConfig(gpu_memory_utilization=value)


def test_gpu_memory_utilization_default_and_bounds():
    assert EngineConfig().gpu_memory_utilization == 0.9
    assert EngineConfig(gpu_memory_utilization=1.0).gpu_memory_utilization == 1.0
    assert EngineConfig(gpu_memory_utilization=0.05).gpu_memory_utilization == 0.05


def test_float_flag_parses_from_the_command_line():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--gpu-memory-utilization", "0.75", "--max-num-seqs", "8"])
    flags = engine_flags(args)
    assert flags == {"gpu_memory_utilization": 0.75, "max_num_seqs": 8}
    assert EngineConfig.from_flags(None, **flags).gpu_memory_utilization == 0.75
    with pytest.raises(SystemExit):
        parser.parse_args(["--gpu-memory-utilization", "most"])


def test_pool_size_precedence():
    """num_kv_blocks, then kv_cache_memory_bytes, then the profiled budget, then 2 GiB."""
    hf = SimpleNamespace(max_position_embeddings=64)
    per_block = 1 << 20
    assert EngineConfig().resolve(hf, per_block, 300 * per_block).num_kv_blocks == 300
    assert EngineConfig().resolve(hf, per_block).num_kv_blocks == 2048  # 2 GiB
    explicit = EngineConfig(kv_cache_memory_bytes=100 * per_block)
    assert explicit.resolve(hf, per_block, 300 * per_block).num_kv_blocks == 100
    exact = EngineConfig(num_kv_blocks=7, kv_cache_memory_bytes=100 * per_block)
    assert exact.resolve(hf, per_block, 300 * per_block).num_kv_blocks == 7


@pytest.mark.parametrize("batched,seqs,block_size,max_model_len,num_tokens,num_seqs,groups", [
    (2048, 256, 16, None, 2048, 256, 1),
    (50, 8, 4, None, 50, 8, 1),  # uneven: two sequences get one token more
    (6, 256, 4, None, 6, 6, 1),  # never more sequences than tokens
    (64, 2, 4, 16, 32, 2, 1),  # no sequence longer than max_model_len
    (50, 8, 4, None, 50, 8, 3),  # a table of its own blocks in each KV-cache group
])
def test_largest_step_fills_the_token_budget(batched, seqs, block_size, max_model_len,
                                             num_tokens, num_seqs, groups):
    step = largest_step(batched, seqs, block_size, max_model_len, groups)
    assert sum(step.num_scheduled_tokens) == num_tokens
    assert len(step.new_requests) == num_seqs == len(set(step.request_ids))
    assert max(step.num_scheduled_tokens) - min(step.num_scheduled_tokens) <= 1
    blocks = [b for data in step.new_requests for table in data.block_ids for b in table]
    assert sorted(blocks) == list(range(num_blocks_needed(step)))  # distinct, none wasted
    for data, n in zip(step.new_requests, step.num_scheduled_tokens):
        assert len(data.token_ids) == data.num_prompt_tokens == n  # whole prompt: it samples
        assert data.num_computed_tokens == 0
        assert len(data.block_ids) == groups
        assert all(len(table) * block_size >= n for table in data.block_ids)
        assert data.sampling_params.logprobs and not data.sampling_params.is_greedy


def test_largest_step_runs_through_the_runner_and_leaves_no_request(tiny_llama_dir):
    backend = select_backend("cpu")
    model = load_model(tiny_llama_dir, torch.float32, "cpu", backend)
    step = largest_step(max_num_batched_tokens=96, max_num_seqs=10, block_size=4,
                        max_model_len=64)
    runner = ModelRunner(model, backend, num_blocks_needed(step), 4, torch.float32,
                         torch.device("cpu"))
    result = run_dummy_step(runner, step)
    assert result.error is None
    assert result.request_ids == step.request_ids  # logits and a sample for every sequence
    assert all(lp is not None for lp in result.logprobs)
    assert runner.requests == {}

    # the profiled runner then takes its real pool and serves as any other
    runner.allocate_kv_cache(0)
    assert all(k.numel() == 0 for k, _ in runner.kv_caches)
    runner.allocate_kv_cache(32)
    assert runner.kv_caches[0][0].shape[0] == 32 and len(runner.kv_caches) == model.num_layers
    real = largest_step(8, 2, 4)
    assert runner.execute(real).request_ids == real.request_ids


@pytest.mark.parametrize("name,windows,layers_per_block", [
    ("gemma3", [None] + [16] * 5, 1),  # 5 sliding layers to 1 full: groups of one layer
    ("gemma2", [None, 16], 2),  # sliding and full in turn
    ("qwen2_window", [None, 16], 2),  # its upper 2 of 4 layers slide
    ("mistral", [16], 2),  # every layer slides: one group of all
])
def test_a_block_is_a_page_in_each_layer_of_one_kv_cache_group(tiny_window_dirs, name, windows,
                                                               layers_per_block):
    budget = 1 << 20
    config = EngineConfig(model=str(tiny_window_dirs[name]), dtype="float32", block_size=4,
                          kv_cache_memory_bytes=budget, device="cpu")
    loaded = load_model_parts(config)
    groups = loaded.parts.kv_cache_groups
    assert [g.window for g in groups] == windows
    assert {len(g.layers) for g in groups} == {layers_per_block}
    # 2 KV heads of 16 in fp32, k and v, 4 tokens a block: in each layer of a group
    assert loaded.config.num_kv_blocks == budget // (2 * layers_per_block * 4 * 2 * 16 * 4)


def test_a_model_of_full_attention_has_one_group_of_every_layer(tiny_llama_dir):
    loaded = load_model_parts(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                           block_size=4, kv_cache_memory_bytes=1 << 20,
                                           device="cpu"))
    assert [(g.window, g.layers) for g in loaded.parts.kv_cache_groups] == [(None, (0, 1))]
    assert loaded.config.num_kv_blocks == (1 << 20) // (2 * 2 * 4 * 2 * 16 * 4)
