"""Bad input gets a clear error, changes nothing, and the engine keeps serving."""

import threading

import pytest

from actorlm import SamplingParams
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


def test_shutdown_leaves_no_thread_behind(tiny_llama_dir):
    before = set(threading.enumerate())
    llm = LLM(str(tiny_llama_dir), dtype="float32")
    llm.generate(["hello world"], OK, use_tqdm=False)
    llm.shutdown()
    for thread in set(threading.enumerate()) - before:
        thread.join(timeout=5)  # stop() returns as an actor's loop ends; its thread exits next
    assert set(threading.enumerate()) - before == set()
