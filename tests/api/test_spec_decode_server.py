"""Speculative decoding through ``actorlm serve``: a greedy stream read by the ``openai`` client
gives the text a server without drafts gives, vLLM's spec-decode counters move on /metrics,
and a grammar with speculation is a 400 naming both."""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from api_helpers import SERVED_NAME, serving

SPEC = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the"


@pytest.fixture(scope="module")
def spec_server(tiny_llama_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("spec") / "server.log"
    with serving(tiny_llama_dir, log_path, "--num-kv-blocks", "256",
                 "--served-model-name", SERVED_NAME, "--speculative-config", SPEC) as (proc, base):
        yield base
        proc.terminate()
        proc.wait(timeout=20)


def _counter(metrics: str, name: str) -> float:
    found = re.search(rf"^{re.escape(name)}_total\{{[^}}]*\}} (\S+)$", metrics, re.M)
    assert found, f"{name} is not on /metrics"
    return float(found.group(1))


def _streamed_text(base_url: str) -> str:
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        stream = client.completions.create(model=SERVED_NAME, prompt=PROMPT, max_tokens=32,
                                           temperature=0.0, stream=True,
                                           extra_body={"ignore_eos": True})
        return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


def test_a_stream_with_drafts_reads_as_one_without(spec_server, server):
    names = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens")
    before = httpx.get(spec_server + "/metrics").text
    assert _streamed_text(spec_server) == _streamed_text(server)
    after = httpx.get(spec_server + "/metrics").text
    for name in names:
        assert _counter(after, name) > _counter(before, name)
    assert _counter(after, "vllm:spec_decode_num_accepted_tokens") <= \
        _counter(after, "vllm:spec_decode_num_draft_tokens")


def test_a_grammar_with_speculation_is_refused_by_name(spec_server):
    reply = httpx.post(spec_server + "/v1/completions", json={
        "model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 4,
        "structured_outputs": {"choice": ["yes", "no"]}}, timeout=30)
    assert reply.status_code == 400, reply.text
    message = reply.json()["error"]["message"]
    assert "structured_outputs" in message and "--speculative-config" in message
    # and the server keeps serving
    assert httpx.get(spec_server + "/health").status_code == 200
    assert _streamed_text(spec_server)
