"""The model's sampling defaults (``--generation-config auto|vllm|<dir>``, vLLM's): a tiny
checkpoint whose generation_config.json asks for temperature 0.01 and top_k 1 answers greedily
to requests that leave sampling to the server, samples when a request brings its own fields,
and samples by default again under ``--generation-config vllm``. Through the server with the
official ``openai`` client (``actorlm serve`` in a subprocess for ``auto``, the app in this
process for ``vllm``), and offline through ``LLM``."""

from __future__ import annotations

import json
import shutil

import argparse

import openai
import pytest
from api_helpers import SERVED_NAME, running, serving

from actorlm import LLM, SamplingParams
from actorlm.api.flags import add_engine_flags, engine_flags
from actorlm.api.server import create_app
from actorlm.async_llm import AsyncLLM
from actorlm.config import EngineConfig
from actorlm.generation_config import load_sampling_defaults

MESSAGES = [{"role": "user", "content": "Once upon a time"}]
PROMPT = "The quick brown fox"
SEEDS = range(4)
N = 6  # choices per request: a sampled request's differ, a greedy one's are one answer
# greedy in effect (one candidate), and max_new_tokens as the default max_tokens
DEFAULTS = {"temperature": 0.01, "top_k": 1, "max_new_tokens": 5}


def with_generation_config(src, dst, **fields):
    """A copy of the checkpoint ``src`` whose generation_config.json also sets ``fields``."""
    shutil.copytree(src, dst)
    path = dst / "generation_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "do_sample": True, **fields}))
    return dst


@pytest.fixture(scope="module")
def greedy_model_dir(tiny_llama_dir, tmp_path_factory):
    return with_generation_config(tiny_llama_dir, tmp_path_factory.mktemp("gencfg") / "model",
                                  **DEFAULTS)


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def auto_server(greedy_model_dir, tmp_path_factory):
    """(client, log path) of a server on the greedy checkpoint with the default ``auto``."""
    log_path = tmp_path_factory.mktemp("gencfg_auto") / "server.log"
    with serving(greedy_model_dir, log_path, "--num-kv-blocks", "256", "--served-model-name",
                 SERVED_NAME) as (proc, base), _client(base) as client:
        yield client, log_path
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def vllm_server(greedy_model_dir):
    """(client, engine) of the app on the same checkpoint, with ``generation_config="vllm"``."""
    engine = AsyncLLM(str(greedy_model_dir), dtype="float32", num_kv_blocks=256,
                      generation_config="vllm")
    try:
        with running(create_app(engine, served_model_name=SERVED_NAME)) as base, \
                _client(base) as client:
            yield client, engine
    finally:
        engine.shutdown()


def chat_texts(client, **kw) -> set[str]:
    """The distinct answers among N choices."""
    answer = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=12,
                                            n=N, seed=0, **kw)
    return {choice.message.content for choice in answer.choices}


def completion_texts(client, **kw) -> set[str]:
    answer = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=12, n=N,
                                       seed=0, **kw)
    return {choice.text for choice in answer.choices}


def test_the_models_defaults_make_it_greedy_and_a_requests_fields_win(auto_server):
    client, log_path = auto_server
    greedy_chat = chat_texts(client, temperature=0.0)
    assert len(greedy_chat) == 1
    assert chat_texts(client) == greedy_chat  # no sampling fields: the model's defaults
    greedy_text = completion_texts(client, temperature=0.0)
    assert completion_texts(client) == greedy_text
    # the request's own fields win, field by field (as in vLLM): a temperature alone still
    # samples among the file's top_k of 1; with top_k of its own it samples for real
    assert chat_texts(client, temperature=1.0) == greedy_chat
    sampled = chat_texts(client, temperature=1.0, extra_body={"top_k": 0})
    assert len(sampled) > 1 and sampled != greedy_chat
    assert len(completion_texts(client, temperature=1.0, extra_body={"top_k": 0})) > 1
    log = log_path.read_text()
    assert "sampling defaults: temperature=0.01, top_k=1, max_tokens=5 from " in log
    assert "generation_config.json" in log


def test_max_new_tokens_is_the_default_max_tokens(auto_server):
    client, _ = auto_server
    eos = {"ignore_eos": True}
    chat = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, extra_body=eos)
    assert chat.usage.completion_tokens == 5
    longer = client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=8,
                                            extra_body=eos)
    assert longer.usage.completion_tokens == 8  # the request's own max_tokens wins
    # completions carry OpenAI's default of 16 (as in vLLM): only an explicit null falls back
    assert client.completions.create(model=SERVED_NAME, prompt=PROMPT,
                                     extra_body=eos).usage.completion_tokens == 16
    assert client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=None,
                                     extra_body=eos).usage.completion_tokens == 5


def test_generation_config_vllm_ignores_the_file(vllm_server):
    client, engine = vllm_server
    assert len(chat_texts(client)) > 1  # vLLM's temperature 1.0: sampled
    assert len(completion_texts(client)) > 1
    assert len(chat_texts(client, temperature=0.0)) == 1
    assert engine.sampling_defaults.describe() == \
        "sampling defaults: vLLM's (--generation-config vllm)"


def test_the_flags_reach_the_engine_config():
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--generation-config", "vllm", "--reasoning-parser", "qwen3"])
    assert engine_flags(args) == {"generation_config": "vllm", "reasoning_parser": "qwen3"}
    assert engine_flags(parser.parse_args([])) == {}  # auto and no parser: EngineConfig's


# --- offline -----------------------------------------------------------------------------------


def test_llm_defaults_apply_without_sampling_params(greedy_model_dir):
    with LLM(str(greedy_model_dir), dtype="float32", num_kv_blocks=64) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.01, 1, 5)
        [by_default] = llm.generate(PROMPT, use_tqdm=False)
        [greedy] = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5),
                                use_tqdm=False)
        assert by_default.outputs[0].token_ids == greedy.outputs[0].token_ids
        assert len(greedy.outputs[0].token_ids) == 5  # max_new_tokens is the default max_tokens
        # explicit SamplingParams are the caller's: the file does not reach into them (vLLM)
        sampled = {tuple(llm.generate(PROMPT, SamplingParams(temperature=1.0, seed=s),
                                      use_tqdm=False)[0].outputs[0].token_ids) for s in SEEDS}
        assert len(sampled) > 1


def test_llm_generation_config_vllm_and_a_directory(tiny_llama_dir, greedy_model_dir):
    with LLM(str(greedy_model_dir), dtype="float32", num_kv_blocks=64,
             generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    # the plain checkpoint's own file sets no sampling field; another folder's does
    assert load_sampling_defaults("auto", tiny_llama_dir).values == {}
    with LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64,
             generation_config=str(greedy_model_dir)) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k) == (0.01, 1)


@pytest.mark.parametrize("fields, message", [
    ({"temperature": -0.5}, r"generation_config.json: temperature must be in \[0, 2\], got -0.5"),
    ({"top_p": 0}, r"generation_config.json: top_p must be in \(0, 1\], got 0"),
    ({"top_k": 2.5}, r"generation_config.json: top_k must be an integer, got 2.5"),
    ({"temperature": "hot"}, r"generation_config.json: temperature must be a number, got 'hot'"),
    # (transformers refuses this one itself)
    ({"max_new_tokens": 0}, r"generation_config.json: .*max_new_tokens.* 0"),
])
def test_a_field_that_makes_no_sense_fails_at_startup(tiny_llama_dir, tmp_path, fields, message):
    bad = with_generation_config(tiny_llama_dir, tmp_path / "bad", **fields)
    with pytest.raises(ValueError, match=message) as caught:
        load_sampling_defaults("auto", bad)
    assert str(bad) in str(caught.value) and "--generation-config vllm" in str(caught.value)
    if fields == {"temperature": -0.5}:  # the engine refuses it before any actor starts
        with pytest.raises(ValueError, match=message):
            LLM(str(bad), dtype="float32", num_kv_blocks=64)
        with LLM(str(bad), dtype="float32", num_kv_blocks=64, generation_config="vllm") as llm:
            assert llm.get_default_sampling_params() == SamplingParams()


def test_the_flag_is_checked_when_the_config_is_built(tmp_path):
    with pytest.raises(ValueError, match="--generation-config: .* is not auto, vllm or a "
                                         "directory holding a generation_config.json"):
        EngineConfig(generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="--generation-config must be auto, vllm or a directory"):
        EngineConfig(generation_config="")


def test_only_what_differs_from_transformers_defaults_counts(tmp_path):
    """vLLM reads ``to_diff_dict``: special-token ids and the like are no sampling defaults,
    and a field left at null is none either."""
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": 2, "top_p": None, "min_p": 0.05,
         "repetition_penalty": 1.1, "do_sample": True}))
    defaults = load_sampling_defaults(str(tmp_path))
    assert defaults.values == {"repetition_penalty": 1.1, "min_p": 0.05}
    assert defaults.sampling_params().min_p == 0.05
    assert "min_p=0.05" in defaults.describe()
    assert load_sampling_defaults("vllm", tmp_path).values == {}


def test_override_generation_config_sets_fields_over_the_file(greedy_model_dir, tiny_llama_dir):
    """vLLM's --override-generation-config: merged over what auto read, alone under vllm;
    a field it cannot set, or a value that makes no sense, is refused naming the flag."""
    with LLM(str(greedy_model_dir), dtype="float32", num_kv_blocks=64,
             override_generation_config='{"temperature": 0.7, "max_new_tokens": 9}') as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.7, 1, 9)
        [out] = llm.generate(PROMPT, use_tqdm=False)
        assert len(out.outputs[0].token_ids) <= 9
        assert "and --override-generation-config" in llm.engine.sampling_defaults.describe()
    overridden = load_sampling_defaults("vllm", tiny_llama_dir, overrides={"top_p": 0.5})
    assert overridden.values == {"top_p": 0.5}
    assert overridden.describe() == ("sampling defaults: top_p=0.5 from "
                                     "--override-generation-config (a request's own fields win)")
    for bad, message in [({"do_sample": False}, "'do_sample' is not a sampling field"),
                         ({"temperature": -1}, "temperature must be in"),
                         ({"top_k": "x"}, "top_k must be an integer"), ([], "a JSON object")]:
        with pytest.raises(ValueError, match=f"--override-generation-config.*{message}"):
            EngineConfig(override_generation_config=bad)
