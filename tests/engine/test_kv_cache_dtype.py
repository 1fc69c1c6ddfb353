"""``--kv-cache-dtype fp8`` (E4M3) and ``fp8_e5m2``: the KV pool stores each K and V value
rounded to FP8 (vLLM's conversion with a scale of one), and attention reads what it holds.
Held to transformers by vLLM's greedy rule, through preemption and prefix hits; the rounding
shows in the logprobs (it is not a cache in the model's dtype under another name); a block
takes a quarter of fp32's bytes, so the same memory holds four times the blocks (a draft
model's pool too); the one-call decode step reads it as the Python layers do."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import TOP, check_logprobs_close, engine_greedy, hf_greedy

from actorlm import SamplingParams
from actorlm.config import EngineConfig

NUM_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 120, 66], [8, 9, 10], [300, 12, 45, 77, 200, 31, 9, 14,
                                                             88, 101, 150, 23, 5]]


@pytest.fixture(scope="module")
def expected(tiny_llama_dir):
    return hf_greedy(tiny_llama_dir, PROMPTS, NUM_TOKENS)


def _greedy(llm):
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return outputs, engine_greedy(outputs)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_cache_keeps_greedy_close_to_transformers(kv_cache_dtype, tiny_llama_dir,
                                                        expected, make_llm):
    auto_outputs, _ = _greedy(make_llm(str(tiny_llama_dir)))
    llm = make_llm(str(tiny_llama_dir), kv_cache_dtype=kv_cache_dtype)
    outputs, ours = _greedy(llm)
    check_logprobs_close(ours, expected)
    # the cache rounded: the chosen tokens' logprobs move off the model's-dtype cache's
    moved = max(abs(a[t].logprob - b[t].logprob)
                for o, r in zip(outputs, auto_outputs)
                for t, a, b in zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                   r.outputs[0].logprobs) if t in b)
    assert moved > 1e-4
    # preemption (recomputed into the FP8 cache) and prefix hits (read back from it)
    squeezed = make_llm(str(tiny_llama_dir), kv_cache_dtype=kv_cache_dtype, block_size=4,
                        num_kv_blocks=12, max_model_len=40, enable_prefix_caching=True)
    check_logprobs_close(_greedy(squeezed)[1], expected)
    assert squeezed.stats()["num_preemptions"] > 0
    check_logprobs_close(_greedy(squeezed)[1], expected)  # the second time, prompts cached


def test_the_same_memory_holds_four_times_the_fp32_blocks(tiny_llama_dir, make_llm):
    budget = {"kv_cache_memory_bytes": 1 << 22}
    auto = make_llm(str(tiny_llama_dir), **budget).config.num_kv_blocks
    assert make_llm(str(tiny_llama_dir), kv_cache_dtype="fp8", **budget
                    ).config.num_kv_blocks == 4 * auto


def test_a_draft_models_cache_is_fp8_too_and_its_drafts_change_no_token(tiny_llama_dir,
                                                                        tiny_llama_draft_dir,
                                                                        make_llm):
    # (its pool beside the target's, of the same dtype, as vLLM's: four times the blocks too)
    flags = {"kv_cache_dtype": "fp8", "kv_cache_memory_bytes": 1 << 22}
    plain = make_llm(str(tiny_llama_dir), **flags)
    spec = make_llm(str(tiny_llama_dir), **flags, speculative_config={
        "model": str(tiny_llama_draft_dir), "num_speculative_tokens": 3})
    auto = make_llm(str(tiny_llama_dir), kv_cache_memory_bytes=1 << 22, speculative_config={
        "model": str(tiny_llama_draft_dir), "num_speculative_tokens": 3})
    assert spec.config.num_kv_blocks == 4 * auto.config.num_kv_blocks
    tokens = [o.outputs[0].token_ids for o in _greedy(spec)[0]]
    assert tokens == [o.outputs[0].token_ids for o in _greedy(plain)[0]]
    assert spec.stats()["spec_num_accepted_tokens"] > 0


@pytest.mark.parametrize("value", ["int8", "fp8_inc", "float16"])
def test_other_cache_dtypes_are_refused_naming_the_known_ones(value):
    with pytest.raises(ValueError, match=f"--kv-cache-dtype '{value}' is not implemented "
                                         r"\(known: auto, fp8, fp8_e4m3, fp8_e5m2\)"):
        EngineConfig(kv_cache_dtype=value)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_the_one_call_decode_step_reads_an_fp8_cache_as_the_python_layers(tiny_llama_dir,
                                                                          cache_dtype):
    # the C++ step runs every decode over the FP8 cache, with the Python layers' bits
    one_call, decodes = _decode(tiny_llama_dir, cache_dtype, python_layers=False)
    python_layers, _ = _decode(tiny_llama_dir, cache_dtype, python_layers=True)
    assert one_call == python_layers and decodes > 0


def _decode(model_dir, cache_dtype, python_layers: bool):
    """(every request's tokens and their logprobs, the one-call step's number of steps) of a
    run of PROMPTS over a cache of ``cache_dtype``."""
    from actorlm.core.scheduler import SchedulerConfig
    from actorlm.kernels import select_backend
    from actorlm.messages import AddRequest
    from actorlm.models.loader import load_model
    from actorlm.models.runner import ModelRunner
    from actorlm.trace.replay import SyncEngine

    backend = select_backend("cpu")
    model = load_model(model_dir, torch.float32, "cpu", backend)
    if python_layers:
        model.decode_step = None
    runner = ModelRunner(model, backend, 48, 4, torch.float32, torch.device("cpu"),
                         kv_cache_dtype=cache_dtype)
    assert runner.kv_caches[0][0].dtype == cache_dtype
    engine = SyncEngine(SchedulerConfig(16, 4, 48, 4), 48, runner=runner)
    for i, prompt in enumerate(PROMPTS):
        engine.send(AddRequest(f"r{i}", prompt, GREEDY, 0, 0.0))
    engine.run_until_idle()
    deltas = [(d.request_id, d.new_token_ids, d.new_logprobs)
              for out in engine.outputs for d in out.deltas]
    return deltas, 0 if python_layers else model.decode_step.num_steps
