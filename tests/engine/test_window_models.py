"""Sliding-window families through the whole engine, against transformers' greedy on the same
weights: contexts run past the window (16 positions), so the block pool gives each sliding
group's old blocks back while the requests decode, and a pool too small for full attention
still serves them (tests/checkpoints.py's tiny Gemma 3, Gemma 2, Mistral, Qwen2, SmolLM3 and
OLMo 3 windows)."""

import pytest
from engine_helpers import TOP, check_logprobs_close, engine_greedy, hf_greedy

from actorlm import SamplingParams
from actorlm.trace import StepSummary, read_jsonl

NUM_TOKENS = 40
PROMPTS = [[5 + (i * 13 + j * 7) % 300 for j in range(6 + 9 * i)] for i in range(4)]


@pytest.mark.parametrize("name", ["gemma3", "gemma2", "qwen2_window", "mistral", "smollm3",
                                  "olmo3", "exaone4", "starcoder2", "cohere2"])
def test_past_the_window_the_engine_gives_transformers_greedy(tiny_window_dirs, make_llm, name,
                                                              tmp_path):
    path, trace = tiny_window_dirs[name], tmp_path / "trace.jsonl"
    # 4 requests of up to 73 tokens: under full attention 61 blocks of 4 tokens in each layer,
    # here room for 48 in 2 layers (one group of Mistral's, one of Gemma 2's, Qwen2's), or for
    # 96 in 1 (Gemma 3's groups of one layer)
    llm = make_llm(str(path), block_size=4, kv_cache_memory_bytes=48 * 2 * (2 * 4 * 2 * 16 * 4),
                   max_model_len=96, max_num_batched_tokens=16, trace_file=str(trace))
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0,
                                          ignore_eos=True, logprobs=TOP), use_tqdm=False)
    check_logprobs_close(engine_greedy(outputs), hf_greedy(path, PROMPTS, NUM_TOKENS))
    windows = llm.engine.kv_cache_windows
    llm.engine.trace.flush()
    steps = [r for r in read_jsonl(trace) if isinstance(r, StepSummary)]
    assert all(len(s.kv_blocks_per_group) == len(windows) for s in steps)
    if windows == [16]:  # Mistral: every layer slides, and nothing had to wait
        assert llm.stats()["num_preemptions"] == 0
    else:  # a full group holds every block, a sliding group only its window's
        full = [g for g, window in enumerate(windows) if window is None]
        sliding = [g for g, window in enumerate(windows) if window is not None]
        assert full and {windows[g] for g in sliding} == {16}
        assert max(min(s.kv_blocks_per_group[g] for g in full) -
                   max(s.kv_blocks_per_group[g] for g in sliding) for s in steps) >= 8


SHARED = [7 + (j * 11) % 290 for j in range(30)]  # a prefix longer than the window
FOLLOW_UPS = [SHARED + [40 + i, 90 + i, 140 + i] for i in range(3)]


@pytest.mark.parametrize("caching", ["on", "off"])
@pytest.mark.parametrize("name", ["gemma3", "gemma2", "qwen2_window", "mistral", "phi3",
                                  "smollm3", "granite", "olmo2", "olmo3", "glm4", "ernie4_5",
                                  "exaone4", "starcoder2", "phi", "cohere", "cohere2", "opt",
                                  "gpt2", "stablelm_parallel", "arcee", "gpt_neox",
                                  "falcon_new", "olmo", "gpt_bigcode_mha"])
def test_prefix_hits_across_the_window_give_transformers_greedy(tiny_window_dirs, make_llm,
                                                                name, caching):
    path = tiny_window_dirs[name]
    llm = make_llm(str(path), block_size=4, max_model_len=96,
                   enable_prefix_caching=caching == "on")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=TOP)
    first = llm.generate([{"prompt_token_ids": SHARED}], params, use_tqdm=False)
    later = llm.generate([{"prompt_token_ids": p} for p in FOLLOW_UPS], params, use_tqdm=False)
    # the follow-ups start from the shared prompt's blocks: every group's hit agrees on 28
    # tokens (7 full blocks; a sliding group holds only those its window reads)
    assert [o.num_cached_tokens for o in later] == ([28] * 3 if caching == "on" else [0] * 3)
    check_logprobs_close(engine_greedy(first + later),
                         hf_greedy(path, [SHARED, *FOLLOW_UPS], 24))


# (not Mistral: with every layer sliding, a running request gives a block back for each it
# takes past its window, so it never grows into a preemption; requests wait to be admitted)
@pytest.mark.parametrize("name", ["gemma3", "gemma2", "qwen2_window", "phi3"])
def test_under_kv_pressure_requests_are_preempted_and_still_give_transformers_greedy(
        tiny_window_dirs, make_llm, name):
    path = tiny_window_dirs[name]
    prompts = [[9 + (i * 17 + j * 5) % 280 for j in range(20 + 4 * i)] for i in range(6)]
    # six requests growing to up to 80 tokens share a pool that holds two or three of them
    llm = make_llm(str(path), block_size=4, max_model_len=96, num_kv_blocks=96,
                   max_num_batched_tokens=32)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                          logprobs=TOP), use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    check_logprobs_close(engine_greedy(outputs), hf_greedy(path, prompts, 40))
