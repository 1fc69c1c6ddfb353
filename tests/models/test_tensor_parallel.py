"""A model split over 2 CPU ranks (gloo) computes what the whole model computes.

Every case runs in one launch of 2 processes (``tp_helpers.run_ranks``): each rank builds its
shard through ``RunnerFactory(..., tensor_parallel_size=2)(rank)`` and is driven step by step
with the same ``ScheduleStep``s, as the executor would send them (``tp_steps.greedy_steps``):
a prefill of 3 prompts (one chunked over two steps, one asking for prompt logprobs), then
greedy decodes, one of them under a grammar bitmask. Rank 0's tokens must equal the unsplit
runner's and transformers'; its logits must match the unsplit runner's to fp32 rounding
(atol 1e-4, rtol 0: the split only reorders sums).
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import _common, _save_tiny
from tp_helpers import run_ranks
from tp_steps import (ATOL, BLOCK_SIZE, BLOCKS_PER_REQUEST, NUM_STEPS, PROMPTS,
                      assert_alike_but_for_int8_steps, greedy_steps, hf_greedy)

from actorlm.config import EngineConfig
from actorlm.models.parallel import TensorParallel, check_tensor_parallel
from actorlm.models.parts import RunnerFactory, load_model_parts

TP = 2


def run_all(tp: TensorParallel, paths: dict) -> dict:
    return {name: greedy_steps(tp, path) for name, path in paths.items()}


@pytest.fixture(scope="module")
def tiny_replicated_kv_dir(tmp_path_factory, tiny_tokenizer_dir):
    """Llama with 4 query heads and 1 KV head (2 ranks each hold a copy of it), biases on
    o_proj and down_proj (added once after the reduce), an untied head and an odd vocabulary
    (padded to split evenly)."""
    from transformers import LlamaConfig

    common = _common(tiny_tokenizer_dir)
    common.update(num_key_value_heads=1, vocab_size=common["vocab_size"] | 1)
    config = LlamaConfig(**common, tie_word_embeddings=False, attention_bias=True,
                         mlp_bias=True, rope_theta=10000.0)
    return _save_tiny(tmp_path_factory, tiny_tokenizer_dir, "tiny_replicated_kv", config, seed=3)


@pytest.fixture(scope="module")
def checkpoints(tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir, tiny_replicated_kv_dir,
                tiny_window_dirs, tiny_moe_dirs, tmp_path_factory):
    from fp8_files import write_fp8
    from gguf_files import write_gguf
    from prequantized_files import write

    from actorlm.models.loader import resolve_model

    files = tmp_path_factory.mktemp("tp_gguf")
    return {"llama_tied": tiny_llama_dir, "qwen2_qkv_bias": tiny_qwen2_dir,
            "qwen3_qk_norm": tiny_qwen3_dir, "llama_replicated_kv": tiny_replicated_kv_dir,
            # sliding windows in KV-cache groups, Gemma's norms and soft-capping, Phi-3's
            # fused q/k/v and gate/up split per rank, Granite's branches scaled after the sum,
            # OLMo 2's q/k norms over projections split across the ranks, q and k reordered
            # for RoPE on part of each head (GLM-4's interleaved, Phi-4-mini's); LayerNorm,
            # ungated MLPs and parallel branches on the Python path (StarCoder2's, Phi-2's
            # with its LM head's bias split by the vocabulary, Cohere's; StableLM's q/k/v
            # biases beside RoPE on a quarter of each head; Nemotron's ReLU squared;
            # GPT-NeoX's and Falcon's q/k/v regrouped from their heads before the split,
            # Falcon-7B's and GPT-BigCode's one KV head on both ranks; OLMo's LayerNorms
            # without weights; each head's own q/k LayerNorms, the rank's heads of them;
            # Hunyuan's q/k norms after RoPE)
            **{name: tiny_window_dirs[name]
               for name in ("gemma3", "gemma2", "mistral", "qwen2_window", "phi3", "smollm3",
                            "granite", "olmo2", "olmo3", "glm4", "phi3_partial", "ernie4_5",
                            "exaone4", "helium", "seed_oss", "starcoder2", "phi", "cohere",
                            "cohere2", "stablelm", "nemotron", "gpt_neox", "falcon",
                            "falcon_new", "olmo", "gpt_bigcode", "stablelm_qk_norm",
                            "cohere_qk_norm", "phi_qk_norm", "hunyuan_dense")},
            # every expert's intermediate features split (from per-expert tensors and from
            # stacked ones), a shared expert's too (gated, and Granite's unscaled), a router on
            # every rank; OLMoE's q/k norms over all heads, its one KV head on both ranks;
            # GPT-OSS's experts' biases split with their features (down's added by one rank)
            # and each rank's heads' sinks
            **{name: tiny_moe_dirs[name]
               for name in ("qwen3_moe", "qwen3_moe_stacked", "qwen2_moe", "mixtral", "olmoe",
                            "granitemoeshared", "glm4_moe", "ernie4_5_moe", "hunyuan_moe",
                            "gpt_oss")},
            # in blocks: o_proj / down_proj split on block boundaries; a tied embedding (looked
            # up as floats per rank); an untied head whose odd vocabulary pads with zero blocks
            **{name: resolve_model(write_gguf(path, files / f"{name}.gguf", type_name))
               for name, path, type_name in [("llama_tied_q8_0", tiny_llama_dir, "Q8_0"),
                                             ("replicated_kv_q4_0", tiny_replicated_kv_dir,
                                              "Q4_0")]},
            # a GPTQ checkpoint's integers in Q4_1 blocks, o/down split by whole groups
            "llama_gptq": write(tiny_llama_dir, files / "gptq", "gptq", symmetric=False)[0],
            # FP8 inputs: o/down's per-token scale over both ranks' shares of the row (one
            # more all-reduce); per group of 32 on each rank's whole groups
            "llama_fp8": write_fp8(tiny_llama_dir, files / "fp8", "channel", "token"),
            "qwen2_fp8_block": write_fp8(tiny_qwen2_dir, files / "fp8_block", "block", "group")}


@pytest.fixture(scope="module")
def split(checkpoints):
    """Every checkpoint on 2 ranks, in one launch: [rank 0's results, rank 1's]."""
    return run_ranks(run_all, TP, checkpoints)


@pytest.mark.parametrize("name", ["llama_tied", "qwen2_qkv_bias", "qwen3_qk_norm",
                                  "llama_replicated_kv", "gemma3", "gemma2", "mistral",
                                  "qwen2_window", "phi3", "smollm3", "granite", "olmo2",
                                  "olmo3", "glm4", "phi3_partial", "ernie4_5", "exaone4",
                                  "helium", "seed_oss", "starcoder2", "phi", "cohere",
                                  "cohere2", "stablelm", "nemotron", "gpt_neox", "falcon",
                                  "falcon_new", "olmo", "gpt_bigcode", "stablelm_qk_norm",
                                  "cohere_qk_norm", "phi_qk_norm", "hunyuan_dense",
                                  "qwen3_moe",
                                  "qwen3_moe_stacked", "qwen2_moe", "mixtral", "olmoe",
                                  "granitemoeshared", "glm4_moe", "ernie4_5_moe", "hunyuan_moe",
                                  "gpt_oss", "llama_fp8",
                                  "qwen2_fp8_block"])
def test_two_ranks_compute_what_one_computes(name, checkpoints, split):
    path = checkpoints[name]
    whole = greedy_steps(TensorParallel(), path)
    ours = split[0][name]
    assert ours["tokens"] == whole["tokens"]
    assert [len(t) for t in ours["tokens"]] == [NUM_STEPS - 1, NUM_STEPS, NUM_STEPS]
    assert ours["tokens"] == [hf_greedy(path, p, len(t)) for p, t in zip(PROMPTS, ours["tokens"])]
    assert len(ours["logits"]) == len(whole["logits"])
    for got, expected in zip(ours["logits"], whole["logits"]):
        assert got.shape == expected.shape  # [N, V]: the padding trimmed off
        torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(expected),
                                   atol=ATOL, rtol=0)
    assert [p[:2] for p in ours["prompt_logprobs"]] == [("r2", 1)]
    for (_, _, got), (_, _, expected) in zip(ours["prompt_logprobs"], whole["prompt_logprobs"]):
        assert [ids for ids, _ in got] == [ids for ids, _ in expected]
        torch.testing.assert_close([lp for _, lp in got], [lp for _, lp in expected],
                                   atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", ["llama_tied_q8_0", "replicated_kv_q4_0", "llama_gptq"])
def test_two_ranks_compute_in_blocks_what_one_computes(name, checkpoints, split):
    whole = greedy_steps(TensorParallel(), checkpoints[name])
    ours = split[0][name]
    assert ours["tokens"] == whole["tokens"]
    # the same activation blocks on both sides (a rank's columns start on a block), so only
    # the order of the fp32 sums differs (and, now and then, an int8 step it carries a value
    # across: the GPTQ file's last row on a Zen 3, by 0.03)
    assert_alike_but_for_int8_steps(ours["logits"], whole["logits"], name)


@pytest.mark.parametrize("name, kv_heads_per_rank", [("llama_tied", 1), ("qwen3_qk_norm", 1),
                                                     ("llama_replicated_kv", 1)])
def test_each_rank_holds_its_share_of_the_kv_cache(name, kv_heads_per_rank, split):
    # [num_blocks, block_size, Hkv on this rank, D]
    shapes = {rank_results[name]["kv_shape"] for rank_results in split}
    assert shapes == {(len(PROMPTS) * BLOCKS_PER_REQUEST, BLOCK_SIZE, kv_heads_per_rank, 16)}


@pytest.mark.parametrize("name, num_routed_layers", [("qwen3_moe", 2), ("mixtral", 2)])
def test_each_rank_holds_half_of_every_experts_features(name, num_routed_layers, split):
    # (the router's id of the first expert, experts held, features of each): 8 experts of 32
    assert [rank_results[name]["experts"] for rank_results in split] == \
        [[(0, 8, 16)] * num_routed_layers] * TP


def test_the_kv_pool_is_sized_by_the_kv_heads_of_one_rank(tiny_llama_dir, tiny_replicated_kv_dir):
    def num_blocks(path, size):
        config = EngineConfig(model=str(path), dtype="float32", block_size=4,
                              kv_cache_memory_bytes=1 << 20, tensor_parallel_size=size)
        return load_model_parts(config).config.num_kv_blocks

    assert num_blocks(tiny_llama_dir, 2) == 2 * num_blocks(tiny_llama_dir, 1)  # 2 KV heads split
    # 1 KV head: every rank holds it whole
    assert num_blocks(tiny_replicated_kv_dir, 2) == num_blocks(tiny_replicated_kv_dir, 1)


def test_a_model_that_does_not_split_is_refused_before_loading(smollm2_dir):
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 does not divide "
                                         r".*'s 9 attention heads"):
        load_model_parts(EngineConfig(model=str(smollm2_dir), tensor_parallel_size=2))


@pytest.mark.parametrize("heads, kv_heads, intermediate, size, error", [
    (8, 4, 64, 2, None),
    (8, 2, 64, 8, None),  # 2 KV heads, 8 ranks: each holds the one its query head reads
    (8, 1, 64, 4, None),
    (8, 8, 64, 3, "does not divide .*'s 8 attention heads"),
    (12, 4, 96, 6, "neither divides .*'s 4 KV heads nor is a multiple"),
    (8, 4, 100, 8, "does not divide .*'s MLP intermediate size 100"),
    (8, 4, {"MLP intermediate size": 64, "experts' intermediate size": 36}, 8,
     "does not divide .*'s experts' intermediate size 36"),
])
def test_the_split_is_checked(heads, kv_heads, intermediate, size, error):
    if error is None:
        check_tensor_parallel("m", heads, kv_heads, intermediate, size)
    else:
        with pytest.raises(ValueError, match=f"--tensor-parallel-size {size} " + error):
            check_tensor_parallel("m", heads, kv_heads, intermediate, size)


@pytest.mark.parametrize("family, changes, error", [
    ("qwen3_moe", {"moe_intermediate_size": 30}, "experts' intermediate size 30"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 50}, "shared expert's intermediate size 50"),
    ("mixtral", {"intermediate_size": 30}, "experts' intermediate size 30"),
])
def test_a_mixture_of_experts_that_does_not_split_is_refused_before_loading(
        family, changes, error, tiny_moe_dirs, tmp_path):
    # only the config: the refusal comes before any weight (or tokenizer) is read
    import json

    config = json.loads((tiny_moe_dirs[family] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ValueError, match=f"--tensor-parallel-size 4 does not divide .*'s "
                                         f"{error}; use a divisor of"):
        load_model_parts(EngineConfig(model=str(tmp_path), tensor_parallel_size=4))


def test_a_rank_without_a_process_group_is_refused(tiny_llama_dir):
    factory = RunnerFactory(tiny_llama_dir, torch.float32, torch.device("cpu"), BLOCK_SIZE,
                            frozenset(), num_kv_blocks=8, tensor_parallel_size=2)
    with pytest.raises(RuntimeError, match="init_tensor_parallel"):
        factory(1)


@pytest.mark.parametrize("flags, refused", [
    ({"distributed_executor_backend": "mp"}, "--distributed-executor-backend mp"),
    ({"distributed_executor_backend": "ray"}, "--distributed-executor-backend ray"),
    ({"tensor_parallel_size": 2}, "--tensor-parallel-size 2"),
])
def test_a_worker_process_on_a_gpu_needs_the_kv_pool_sized_by_a_flag(flags, refused,
                                                                      tiny_llama_dir):
    # profiling would load the weights here and the worker process again beside them; the
    # refusal comes before anything touches a GPU, so it is checked on any machine
    with pytest.raises(ValueError, match=f"{refused} on a GPU needs the KV pool sized by "
                                         f"--num-kv-blocks or --kv-cache-memory-bytes"):
        load_model_parts(EngineConfig(model=str(tiny_llama_dir), device="cuda", **flags))


@pytest.mark.parametrize("rank, visible, gpu", [(0, 4, 0), (1, 4, 1), (3, 4, 3), (1, 1, 0),
                                                (5, 4, 1)])
def test_each_rank_runs_on_a_gpu_of_its_own(rank, visible, gpu, monkeypatch):
    from actorlm.models import parallel

    chosen, joined = [], []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.distributed, "init_process_group",
                        lambda backend, **kw: joined.append((backend, kw["rank"])))
    parallel.init_tensor_parallel(rank, 8, "tcp://127.0.0.1:1", torch.device("cuda"))
    assert chosen == [gpu] and joined == [("nccl", rank)]


def test_a_rank_that_sees_no_gpu_is_refused_by_name(monkeypatch):
    from actorlm.models import parallel

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(RuntimeError, match="tensor-parallel rank 1 sees no GPU"):
        parallel.init_tensor_parallel(1, 2, "tcp://127.0.0.1:1", torch.device("cuda"))


@pytest.mark.parametrize("device, bundle", [("cuda", {"CPU": 1, "GPU": 1}),
                                            ("cpu", {"CPU": 1})])
def test_a_ray_rank_asks_for_the_gpu_its_model_runs_on(device, bundle, tiny_llama_dir):
    from actorlm.executors.ray_group import rank_bundle

    factory = RunnerFactory(tiny_llama_dir, torch.float32, torch.device(device), BLOCK_SIZE,
                            frozenset(), num_kv_blocks=8, tensor_parallel_size=2)
    assert rank_bundle(factory) == bundle
