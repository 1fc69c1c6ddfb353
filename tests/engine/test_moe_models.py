"""The mixture-of-experts families through the whole engine, against transformers' greedy on
the same weights (tests/checkpoints.py's tiny Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, Granite
MoE, GLM-4.5, ERNIE 4.5, Hunyuan, GPT-OSS): prompts
prefilled in chunks, follow-ups that start from cached prefix blocks, and requests preempted
and recomputed under KV pressure all route their tokens as transformers does."""

import pytest
from engine_helpers import TOP, check_logprobs_close, engine_greedy, hf_greedy

from actorlm import SamplingParams

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe", "granitemoeshared",
            "glm4_moe", "ernie4_5_moe", "hunyuan_moe", "gpt_oss"]
SHARED = [7 + (j * 11) % 290 for j in range(30)]
FOLLOW_UPS = [SHARED + [40 + i, 90 + i, 140 + i] for i in range(3)]
PRESSED = [[9 + (i * 17 + j * 5) % 280 for j in range(20 + 4 * i)] for i in range(6)]
NUM_TOKENS = 24


def _greedy(num_tokens):
    return SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True, logprobs=TOP)


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_prefix_hits_give_transformers_greedy(tiny_moe_dirs, make_llm,
                                                                  family):
    path = tiny_moe_dirs[family]
    # 8 tokens a step: the 30-token shared prompt prefills in 4 chunks
    llm = make_llm(str(path), block_size=4, max_model_len=96, max_num_batched_tokens=8)
    first = llm.generate([{"prompt_token_ids": SHARED}], _greedy(NUM_TOKENS), use_tqdm=False)
    later = llm.generate([{"prompt_token_ids": p} for p in FOLLOW_UPS], _greedy(NUM_TOKENS),
                         use_tqdm=False)
    # the follow-ups start from the shared prompt's 7 full blocks
    assert [o.num_cached_tokens for o in later] == [28] * 3
    check_logprobs_close(engine_greedy(first + later),
                         hf_greedy(path, [SHARED, *FOLLOW_UPS], NUM_TOKENS))


@pytest.mark.parametrize("family", FAMILIES)
def test_under_kv_pressure_requests_are_preempted_and_still_give_transformers_greedy(
        tiny_moe_dirs, make_llm, family):
    path = tiny_moe_dirs[family]
    # six requests growing to up to 80 tokens share a pool that holds two or three of them
    llm = make_llm(str(path), block_size=4, max_model_len=96, num_kv_blocks=96,
                   max_num_batched_tokens=32)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PRESSED], _greedy(40),
                           use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    check_logprobs_close(engine_greedy(outputs), hf_greedy(path, PRESSED, 40))
