"""Bad input gets a clear error, changes nothing, and the engine keeps serving."""

import math
import threading

import pytest

from actorlm import BeamSearchParams, SamplingParams
from actorlm.config import EngineConfig
from actorlm.llm import LLM

OK = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_unknown_model_path_names_the_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match="no-such-model"):
        LLM(str(missing))


@pytest.mark.parametrize("flags,flag_named", [
    ({"dtype": "float64"}, "--dtype"), ({"block_size": 0}, "--block-size"),
    ({"max_model_len": 100000}, "--max-model-len"), ({"num_kv_blocks": 2}, "--num-kv-blocks"),
    ({"tensor_parallel_sizee": 2}, "tensor_parallel_sizee"),
])
def test_bad_engine_flags_name_the_flag(tiny_llama_dir, flags, flag_named):
    with pytest.raises(ValueError, match=flag_named):
        LLM(str(tiny_llama_dir), **flags)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.5), ("temperature", 5e9), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.5), ("max_tokens", 0), ("n", 0), ("stop_token_ids", [-1]),
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0.0),
    ("min_tokens", -1), ("logprobs", -1), ("stop", [""]),
])
def test_bad_sampling_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bad_prompts_are_refused_and_the_engine_keeps_serving(tiny_llama_dir, make_llm):
    llm = make_llm(str(tiny_llama_dir), max_model_len=32)
    good = {"prompt_token_ids": [5, 6, 7]}
    cases = [
        ({"prompt_token_ids": list(range(5, 45))}, "maximum context length is 32 tokens"),
        ({"prompt_token_ids": [5, 10**9]}, "outside the vocabulary"),
        ({"prompt_token_ids": []}, "empty"),
        ("", "empty"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([good, bad], OK, use_tqdm=False)  # the good one is withdrawn too
    # checks that need the model happen at submission
    params_cases = [(dict(logprobs=21), "logprobs: at most 20"),
                    (dict(prompt_logprobs=50), "prompt_logprobs: at most 20"),
                    (dict(logit_bias={10**6: 1.0}), "logit_bias: token id 1000000"),
                    (dict(allowed_token_ids=[3, -4]), "allowed_token_ids: token id -4")]
    for fields, message in params_cases:
        with pytest.raises(ValueError, match=message):
            llm.generate([good, good], [OK, SamplingParams(max_tokens=4, **fields)], use_tqdm=False)
    outputs = llm.generate([good, good], OK, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [4, 4]
    # the withdrawn ones ended as aborts
    assert llm.stats()["num_finished"] == 2 + len(cases) + len(params_cases)


def test_max_logprobs_caps_what_a_request_may_ask_for(tiny_llama_dir, make_llm):
    """vLLM's max_logprobs: 20 by default (above), any cap the engine is given, and -1 for the
    whole vocabulary; a beam search's 2 x beam_width candidates a step count against it."""
    good = {"prompt_token_ids": [5, 6, 7]}
    llm = make_llm(str(tiny_llama_dir), max_logprobs=30)
    out = llm.generate([good], SamplingParams(max_tokens=2, temperature=0.0, logprobs=30,
                                              prompt_logprobs=30), use_tqdm=False)[0]
    assert [len(position) for position in out.outputs[0].logprobs] == [30, 30]  # (greedy)
    # the top 30, and the prompt's own token where it is not among them
    assert all(len(position) in (30, 31) for position in out.prompt_logprobs[1:])
    with pytest.raises(ValueError, match="logprobs: at most 30 are supported .--max-logprobs., "
                                         "got 31"):
        llm.generate([good], SamplingParams(max_tokens=2, logprobs=31), use_tqdm=False)
    assert len(llm.beam_search([[5, 6]], BeamSearchParams(beam_width=15, max_tokens=2))[0]
               .sequences) == 15
    whole = make_llm(str(tiny_llama_dir), max_logprobs=-1)
    vocab = whole.engine.hf_config.vocab_size
    out = whole.generate([good], SamplingParams(max_tokens=1, logprobs=vocab), use_tqdm=False)
    position = out[0].outputs[0].logprobs[0]
    assert len(position) == vocab
    assert math.isclose(sum(math.exp(lp.logprob) for lp in position.values()), 1.0,
                        rel_tol=1e-4)
    for bad in (-2, 1.5, True):
        with pytest.raises(ValueError, match="--max-logprobs must be -1"):
            EngineConfig(max_logprobs=bad)


def test_shutdown_leaves_no_thread_behind(tiny_llama_dir):
    before = set(threading.enumerate())
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    llm.generate(["hello world"], OK, use_tqdm=False)
    llm.shutdown()
    for thread in set(threading.enumerate()) - before:
        thread.join(timeout=5)  # stop() returns as an actor's loop ends; its thread exits next
    assert set(threading.enumerate()) - before == set()
