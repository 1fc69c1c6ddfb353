"""Greedy output of the whole actor engine against transformers' greedy on the same weights:
equal, or close by vLLM's rule (``check_logprobs_close``: at the first difference each side's
token is among the other's top 5). Faster GEMMs may move the last bits, not the answers."""

import random

import pytest
from engine_helpers import TOP, check_logprobs_close, engine_greedy, hf_greedy

from actorlm import SamplingParams

NUM_TOKENS = 32
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)


def mixed_prompts(vocab_size: int, lengths=(3, 17, 9, 30, 1, 24, 12)) -> list[list[int]]:
    rng = random.Random(1234)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def cases(tiny_llama_dir, tiny_qwen2_dir, tiny_qwen3_dir):
    """(model dir, prompts, transformers' greedy tokens) per architecture, computed once."""
    from transformers import AutoConfig

    out = {}
    for name, path in [("llama", tiny_llama_dir), ("qwen2", tiny_qwen2_dir),
                       ("qwen3", tiny_qwen3_dir)]:
        prompts = mixed_prompts(AutoConfig.from_pretrained(path).vocab_size)
        out[name] = (path, prompts, hf_greedy(path, prompts, NUM_TOKENS))
    return out


def generate(llm, prompts):
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    return engine_greedy(outputs)


@pytest.fixture(scope="module")
def batched(cases):
    """The engine's own greedy output with the whole batch at once, per architecture."""
    from actorlm.llm import LLM

    out = {}
    for name, (path, prompts, expected) in cases.items():
        with LLM(str(path), dtype="float32") as llm:
            out[name] = generate(llm, prompts)
            assert llm.stats()["num_preemptions"] == 0
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_batch_of_mixed_lengths(arch, cases, batched):
    path, prompts, expected = cases[arch]
    check_logprobs_close(batched[arch], expected)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_under_kv_pressure_requests_are_preempted_and_recomputed(arch, cases, batched, make_llm):
    path, prompts, expected = cases[arch]
    # 7 requests of up to 62 tokens share 20 blocks of 4 tokens: preemption is unavoidable
    llm = make_llm(str(path), block_size=4, num_kv_blocks=20, max_model_len=64)
    ours = generate(llm, prompts)
    check_logprobs_close(ours, expected)
    assert llm.stats()["num_preemptions"] > 0
    check_logprobs_close(ours, batched[arch])  # the recompute changed nothing that matters


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_chunked_prefill(arch, cases, make_llm):
    path, prompts, expected = cases[arch]
    llm = make_llm(str(path), max_num_batched_tokens=8, block_size=4)
    check_logprobs_close(generate(llm, prompts), expected)


def test_a_long_prefill_threshold_splits_prompts_and_changes_no_answer(cases, make_llm,
                                                                        tmp_path):
    from actorlm.trace import StepSummary, read_jsonl

    path, prompts, expected = cases["llama"]
    llm = make_llm(str(path), long_prefill_token_threshold=5, block_size=4,
                   trace_file=str(tmp_path / "trace.jsonl"))
    check_logprobs_close(generate(llm, prompts), expected)
    records = read_jsonl(tmp_path / "trace.jsonl")
    assert records[0].long_prefill_token_threshold == 5  # (a replay schedules alike)
    steps = [r for r in records if isinstance(r, StepSummary)]
    assert max(n for step in steps for n in step.num_scheduled_tokens) == 5
    with pytest.raises(ValueError, match="--long-prefill-token-threshold splits prompts"):
        make_llm(str(path), long_prefill_token_threshold=5, enable_chunked_prefill=False)


def test_the_closeness_rule_refuses_a_difference_outside_the_top_5():
    top = [{1, 2, 3, 4, 5}] * 3
    assert check_logprobs_close([([1, 2, 3], top)], [([1, 2, 3], top)]) == 1
    assert check_logprobs_close([([1, 2, 9], top)], [([1, 3, 3], top)]) == 0  # a near-tie
    with pytest.raises(AssertionError, match="position 1"):
        check_logprobs_close([([1, 9, 3], top)], [([1, 2, 3], top)])
