"""Speculative decoding changes how many forwards a request takes, never its greedy tokens, on a
tiny model for k = 1, 3, 5, with prefix caching, chunked prefill and forced preemption.

A random model rarely repeats itself, so prompt lookup would rarely be right about it; these
tests give the runner a proposer that knows the answer (the same engine's output without
speculation) and spoils one draft in most proposals, at a place that moves with the length.
So every verification outcome occurs — no draft accepted, some, all of them plus the bonus —
and each must yield the tokens (and the top-5 logprobs) of the run without drafts."""

import random

import pytest
from engine_helpers import TOP, engine_greedy
from greedy import check_logprobs_close
from spec_proposers import KnowingProposer

import actorlm.models.parts
from actorlm import LLM, SamplingParams
from actorlm.kernels.cpu import linear as cpu_linear
from actorlm.kernels.cpu.decode_step import DecodeStep

NUM_TOKENS = 40
VOCAB = 200  # prompt ids are drawn below this (the tiny tokenizer has more)


def _prompts(seed=3):
    """Prompts that repeat a passage (where prompt lookup finds drafts) and some that do not."""
    rng = random.Random(seed)
    prompts = []
    for length in (12, 30, 47):
        passage = [rng.randrange(3, VOCAB) for _ in range(length)]
        prompts.append(passage + passage[:length // 2])
    return prompts + [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (9, 33)]


def _greedy(llm, prompts, num_tokens=NUM_TOKENS):
    """Each prompt's tokens and the top-5 ids at each (an accepted draft's logprobs are the
    target model's: those of the same position without speculation)."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=TOP)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return engine_greedy(outputs)


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("setting", ["roomy", "chunked", "preempting"])
def test_greedy_tokens_are_those_without_speculation(make_llm, tiny_llama_dir, monkeypatch, k,
                                                     setting):
    flags = {"roomy": {}, "chunked": {"max_num_batched_tokens": 16},
             "preempting": {"num_kv_blocks": 40, "block_size": 4, "max_model_len": 128}}[setting]
    prompts = _prompts()
    expected = _greedy(make_llm(str(tiny_llama_dir), **flags), prompts)
    answers = [p + tokens for p, (tokens, _) in zip(prompts, expected)]
    monkeypatch.setattr(actorlm.models.parts, "NgramProposer",
                        lambda k, *_: KnowingProposer(answers, k))
    spec = make_llm(str(tiny_llama_dir), **flags,
                    speculative_config={"method": "ngram", "num_speculative_tokens": k})
    assert _greedy(spec, prompts) == expected
    stats = spec.stats()
    accepted = stats["spec_accepted_per_position"]
    assert len(accepted) == k and all(n > 0 for n in accepted)  # every depth was reached
    assert stats["spec_num_draft_tokens"] > stats["spec_num_accepted_tokens"]  # some failed
    if setting == "preempting":
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize("k, setting", [(1, "roomy"), (3, "chunked"), (5, "preempting")])
def test_a_draft_models_drafts_leave_the_greedy_tokens_unchanged(make_llm, tiny_llama_dir,
                                                                 tiny_llama_draft_dir, k,
                                                                 setting):
    """A draft model (the tiny Llama with noisy MLPs) is right about some drafts: whatever
    it proposes, the tokens and top-5 logprobs are those without speculation."""
    flags = {"roomy": {}, "chunked": {"max_num_batched_tokens": 16},
             "preempting": {"num_kv_blocks": 40, "block_size": 4, "max_model_len": 128}}[setting]
    prompts = _prompts()
    expected = _greedy(make_llm(str(tiny_llama_dir), **flags), prompts)
    spec = make_llm(str(tiny_llama_dir), **flags, speculative_config={
        "model": str(tiny_llama_draft_dir), "num_speculative_tokens": k})
    assert _greedy(spec, prompts) == expected
    stats = spec.stats()
    assert all(n > 0 for n in stats["spec_accepted_per_position"])  # every depth was reached
    assert 0 < stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]
    if setting == "preempting":
        assert stats["num_preemptions"] > 0


def test_a_draft_model_with_another_vocabulary_is_refused_before_loading(tiny_llama_dir,
                                                                         tmp_path):
    import json
    import shutil

    draft = tmp_path / "draft"
    shutil.copytree(tiny_llama_dir, draft)
    config = json.loads((draft / "config.json").read_text())
    config["vocab_size"] += 1
    (draft / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"draft model '{draft}' has a vocabulary of "
                                         f"{config['vocab_size']} tokens"):
        LLM(str(tiny_llama_dir), speculative_config={"model": str(draft),
                                                     "num_speculative_tokens": 2})


@pytest.mark.parametrize("k", [1, 5])
def test_bf16_greedy_tokens_are_close_to_those_without_speculation(make_llm, tiny_llama_dir,
                                                                   monkeypatch, k):
    """In bf16 a verification's k + 1 rows may round differently from k + 1 one-row steps, so
    a near-tie may go the other way: vLLM's check_logprobs_close is the bar."""
    prompts = _prompts()
    expected = _greedy(make_llm(str(tiny_llama_dir), dtype="bfloat16",
                                max_num_batched_tokens=16), prompts)
    monkeypatch.setattr(actorlm.models.parts, "NgramProposer", lambda k, *_: KnowingProposer(
        [p + tokens for p, (tokens, _) in zip(prompts, expected)], k))
    spec = make_llm(str(tiny_llama_dir), dtype="bfloat16", max_num_batched_tokens=16,
                    speculative_config={"method": "ngram", "num_speculative_tokens": k})
    check_logprobs_close(_greedy(spec, prompts), expected)
    assert spec.stats()["spec_num_accepted_tokens"] > 0


def test_stops_max_tokens_and_n_cut_drafts_as_without_speculation(make_llm, tiny_llama_dir,
                                                                   monkeypatch):
    """A stop token, a stop string or max_tokens inside a run of accepted drafts ends the
    output there, for each of n = 2 samples, with the text and finish reason of no drafts."""
    prompts = _prompts()
    base = make_llm(str(tiny_llama_dir))
    free = _greedy(base, prompts)
    free_text = base.generate([{"prompt_token_ids": prompts[2]}],
                              SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0,
                                             ignore_eos=True), use_tqdm=False)
    text = free_text[0].outputs[0].text
    params = SamplingParams(max_tokens=33, temperature=0.0, n=2, stop=[text[len(text) // 2:][:4]],
                            stop_token_ids=[free[0][0][17]])

    def outcome(llm):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        return [[(c.text, list(c.token_ids), c.finish_reason, c.stop_reason) for c in o.outputs]
                for o in outputs]

    expected = outcome(base)
    reasons = {type(c[3]) for o in expected for c in o}
    assert reasons == {str, int, type(None)}  # a stop string, a stop token, max_tokens
    monkeypatch.setattr(actorlm.models.parts, "NgramProposer", lambda k, *_: KnowingProposer(
        [p + tokens for p, (tokens, _) in zip(prompts, free)], k))
    spec = make_llm(str(tiny_llama_dir),
                    speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    assert outcome(spec) == expected
    assert spec.stats()["spec_num_accepted_tokens"] > 0


@pytest.mark.skipif(cpu_linear._kernel() is None,
                    reason="the fp32 panel GEMM needs AVX-512 or AVX2 and FMA, and a C++ compiler")
def test_verification_steps_take_the_one_call_decode_step(make_llm, tiny_llama_dir, monkeypatch):
    """A request verifying k drafts attends as k + 1 decode rows, so the step runs every layer
    in one C++ call (the Python layers would run it as a short prefill)."""
    k, prompt = 3, _prompts()[1]
    expected = _greedy(make_llm(str(tiny_llama_dir), dtype="float32"), [prompt])
    monkeypatch.setattr(actorlm.models.parts, "NgramProposer",
                        lambda k, *_: KnowingProposer([prompt + expected[0][0]], k))
    calls = []  # (rows, whether the one call ran them) of every forward
    one_call = DecodeStep.__call__
    monkeypatch.setattr(DecodeStep, "__call__", lambda step, x, *args: calls.append(
        (x.shape[0], (out := one_call(step, x, *args)) is not None)) or out)
    spec = make_llm(str(tiny_llama_dir), dtype="float32",
                    speculative_config={"method": "ngram", "num_speculative_tokens": k})
    assert _greedy(spec, [prompt]) == expected
    verifications = [took for rows, took in calls if 1 < rows <= k + 1]
    assert len(verifications) == spec.stats()["spec_num_drafts"] > 0
    assert all(verifications)
    assert [took for rows, took in calls if rows == len(prompt)] == [False]  # the prefill


@pytest.mark.slow
def test_the_triton_backend_verifies_drafts_to_the_same_tokens(make_llm, tiny_llama_dir,
                                                               monkeypatch):
    """The Triton kernels (CPU interpreter) attend a verification's rows as decode rows too."""
    prompts, k = _prompts()[:2], 3
    expected = _greedy(make_llm(str(tiny_llama_dir)), prompts, num_tokens=12)
    monkeypatch.setattr(actorlm.models.parts, "NgramProposer", lambda k, *_: KnowingProposer(
        [p + tokens for p, (tokens, _) in zip(prompts, expected)], k))
    monkeypatch.setenv("ACTORLM_ATTENTION_BACKEND", "triton")
    spec = make_llm(str(tiny_llama_dir), dtype="float32",
                    speculative_config={"method": "ngram", "num_speculative_tokens": k})
    assert spec.engine.backend_name == "triton"
    assert [t for t, _ in _greedy(spec, prompts, num_tokens=12)] == [t for t, _ in expected]
    assert spec.stats()["spec_num_accepted_tokens"] > 0


PASSAGE = ("The old baker rose every morning before the sun to bake bread for the village. "
           "Children would gather at his door to smell the loaves, and he gave each of them a "
           "warm roll before they walked to school along the river.")


@pytest.mark.slow
def test_prompt_lookup_on_smollm2_keeps_its_greedy_tokens_and_saves_steps(make_llm):
    """The real proposer on the default model, asked to repeat a passage: most drafts are
    right, and the tokens are those of the engine without them."""
    base = make_llm(None)
    chat = [{"role": "user", "content": f"Repeat this text exactly:\n\n{PASSAGE}"}]
    prompt = base.apply_chat_template(chat)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    expected = base.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    spec = make_llm(None, speculative_config={"method": "ngram", "num_speculative_tokens": 5,
                                              "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    got = spec.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    stats, steps = spec.stats(), base.stats()["num_steps"]
    assert stats["spec_num_accepted_tokens"] >= stats["spec_num_draft_tokens"] / 2
    assert stats["num_steps"] < steps * 0.6  # a verification yields several tokens


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tensor_parallel_ranks_verify_the_same_drafts(make_llm, tiny_llama_dir,
                                                      tiny_llama_draft_dir, method):
    """TP=2 over worker processes with prompt lookup, or a draft model that rank 0 alone
    runs: rank 1 reads the drafts from the step and learns what was accepted from the next
    one; the tokens are TP=1's without drafts."""
    prompts = _prompts()
    expected = _greedy(make_llm(str(tiny_llama_dir)), prompts, num_tokens=64)
    proposer = {"ngram": {"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3},
                "draft_model": {"model": str(tiny_llama_draft_dir)}}[method]
    spec = make_llm(str(tiny_llama_dir), tensor_parallel_size=2,
                    distributed_executor_backend="mp",
                    speculative_config={**proposer, "num_speculative_tokens": 3})
    assert [t for t, _ in _greedy(spec, prompts, num_tokens=64)] == [t for t, _ in expected]
    assert spec.stats()["spec_num_draft_tokens"] > 0
