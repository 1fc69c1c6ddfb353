"""vLLM's ``--logprobs-mode``: what a request's logprobs report. Against transformers' logits
on the same weights, and the sampling distribution's oracle (``reference.sampling_probs_ref``):
the raw logits' logprobs or the raw logits; the processed ones, as the token is drawn from
them (the bias, then a random request's temperature and its top-k / top-p cuts at -inf; a
greedy request's after the bias alone), as logprobs or logits. The mode changes no token."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from actorlm import SamplingParams
from actorlm.kernels.reference import sampling_probs_ref

PROMPT = [11, 42, 7, 99, 23]
BIAS = {17: 3.0, 29: -2.0}
RANDOM = SamplingParams(max_tokens=4, temperature=0.7, top_k=6, top_p=0.9, seed=3,
                        ignore_eos=True, logprobs=12, logit_bias=BIAS, prompt_logprobs=2)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=12,
                        logit_bias=BIAS)
MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


@pytest.fixture(scope="module")
def runs(tiny_llama_dir):
    """mode -> (the random request's output, the greedy one's)."""
    from actorlm.llm import LLM

    out = {}
    for mode in MODES:
        with LLM(str(tiny_llama_dir), dtype="float32", logprobs_mode=mode) as llm:
            out[mode] = llm.generate([{"prompt_token_ids": PROMPT}] * 2, [RANDOM, GREEDY],
                                     use_tqdm=False)
    return out


def _expected(logits: torch.Tensor, params: SamplingParams, mode: str) -> torch.Tensor:
    """[V] float64: what the mode reports for one position of transformers' ``logits``."""
    logits = logits.double()
    if mode.startswith("raw"):
        return logits if mode == "raw_logits" else torch.log_softmax(logits, -1)
    for token_id, bias in BIAS.items():
        logits[token_id] += bias
    if params.temperature == 0:
        return logits if mode == "processed_logits" else torch.log_softmax(logits, -1)
    one = torch.ones(1)
    probs = sampling_probs_ref(logits[None], one * params.temperature, one * params.top_k,
                               one * params.top_p, one * params.min_p)[0]
    kept = logits / params.temperature if mode == "processed_logits" else probs.log()
    return kept.masked_fill(probs == 0, -math.inf)


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_reports_what_it_says_and_changes_no_token(runs, tiny_llama_dir, mode):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for output, other, params in zip(runs[mode], runs["raw_logprobs"], (RANDOM, GREEDY)):
        completion = output.outputs[0]
        assert completion.token_ids == other.outputs[0].token_ids
        with torch.inference_mode():
            logits = model(torch.tensor([PROMPT + completion.token_ids])).logits[0]
        for j, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            expected = _expected(logits[len(PROMPT) - 1 + j], params, mode)
            assert set(entry) >= {token} and len(entry) >= params.logprobs
            for token_id, logprob in entry.items():
                want = float(expected[token_id])
                assert logprob.logprob == pytest.approx(want, abs=2e-4) or \
                    logprob.logprob == want == -math.inf, (mode, j, token_id)
        if params.prompt_logprobs:  # a prompt's: raw, as logprobs or logits
            raw = _expected(logits[0], params, "raw_logits" if mode.endswith("logits")
                            else "raw_logprobs")
            assert output.prompt_logprobs[1][PROMPT[1]].logprob == \
                pytest.approx(float(raw[PROMPT[1]]), abs=2e-4)


def test_an_unknown_mode_is_refused_by_name():
    from actorlm.config import EngineConfig

    with pytest.raises(ValueError, match="--logprobs-mode must be one of raw_logprobs"):
        EngineConfig(logprobs_mode="logits")


def test_speculative_steps_report_the_same_processed_logprobs(tiny_llama_dir):
    """Drafts verified in one step (``verify``) report what one token a step reports."""
    from actorlm.llm import LLM

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=5,
                            logit_bias=BIAS)
    prompt = {"prompt_token_ids": PROMPT * 3}  # (repeats: the n-gram proposer finds drafts)
    found = []
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3,
                        "prompt_lookup_max": 3, "prompt_lookup_min": 1}):
        with LLM(str(tiny_llama_dir), dtype="float32", logprobs_mode="processed_logprobs",
                 speculative_config=spec) as llm:
            found.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0])
            if spec is not None:
                assert llm.stats()["spec_num_draft_tokens"] > 0
    plain, drafted = found
    assert drafted.token_ids == plain.token_ids
    for a, b in zip(plain.logprobs, drafted.logprobs):
        assert a.keys() == b.keys()
        for token_id in a:
            assert a[token_id].logprob == pytest.approx(b[token_id].logprob, abs=1e-4)
