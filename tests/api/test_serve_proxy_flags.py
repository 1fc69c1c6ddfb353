"""vLLM's serve flags for a server behind a proxy or a load balancer, on one server:
--root-path (the prefix the proxy strips), --enable-force-include-usage (every stream ends with
its usage), --disable-fastapi-docs (no /openapi.json), /load's count of the requests in
progress (--enable-server-load-tracking), --enable-log-requests / --enable-log-outputs /
--max-log-len, --chat-template-content-format, and --enable-request-id-headers, which asks for
what the server always does. The official openai client reads the streams."""

from __future__ import annotations

import time

import httpx
import pytest
from api_helpers import SERVED_NAME, openai_client, serving

from actorlm.api.openapi import openapi_document
from actorlm.api.options import ServerOptions

MAX_LOG_LEN = 6


@pytest.fixture(scope="module")
def proxied(tiny_llama_long_dir, tmp_path_factory):
    """(base URL, log file) of a server started with the flags (a model whose requests may
    outlive a few seconds)."""
    log_path = tmp_path_factory.mktemp("proxied") / "server.log"
    with serving(tiny_llama_long_dir, log_path, "--served-model-name", SERVED_NAME,
                 "--root-path", "/llm", "--enable-force-include-usage",
                 "--disable-fastapi-docs", "--enable-request-id-headers",
                 "--enable-server-load-tracking", "--enable-log-requests",
                 "--enable-log-outputs", "--max-log-len", str(MAX_LOG_LEN),
                 "--chat-template-content-format", "openai", "--trust-request-chat-template",
                 "--num-kv-blocks", "1024") as (proc, base):
        yield base, log_path
        proc.terminate()
        proc.wait(timeout=20)


def _load(base: str) -> int:
    return httpx.get(base + "/load", timeout=10).json()["server_load"]


def _until_load(base: str, wanted: int) -> None:
    deadline = time.monotonic() + 10
    while _load(base) != wanted:
        assert time.monotonic() < deadline, f"/load stayed at {_load(base)}, not {wanted}"
        time.sleep(0.05)


def test_the_routes_answer_as_the_proxy_forwards_them_and_the_docs_are_off(proxied):
    base, log_path = proxied
    with openai_client(base) as client:
        assert client.models.list().data[0].id == SERVED_NAME
    assert httpx.get(base + "/openapi.json", timeout=10).status_code == 404
    answer = httpx.get(base + "/health", headers={"X-Request-Id": "from-the-balancer"})
    assert answer.headers["x-request-id"] == "from-the-balancer"
    log = log_path.read_text()
    assert "--enable-request-id-headers: nothing to do" in log
    assert "--enable-server-load-tracking: nothing to do" in log


def test_the_document_names_the_prefix_as_its_server():
    assert openapi_document(False, root_path="/llm")["servers"] == [{"url": "/llm"}]
    assert "servers" not in openapi_document(False)
    for bad in ("llm", "/llm/"):
        with pytest.raises(ValueError, match="--root-path"):
            ServerOptions(root_path=bad)
    with pytest.raises(ValueError, match="--max-log-len"):
        ServerOptions(max_log_len=-1)


def test_every_stream_ends_with_its_usage_unasked(proxied):
    base, _ = proxied
    with openai_client(base) as client:
        chunks = list(client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            temperature=0.0, stream=True, extra_body={"ignore_eos": True}))
        assert [c.usage for c in chunks[:-1]] == [None] * (len(chunks) - 1)
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
        completion = list(client.completions.create(
            model=SERVED_NAME, prompt="Hello", max_tokens=3, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True}))
        assert completion[-1].choices == [] and completion[-1].usage.completion_tokens == 3
        # a request that does not stream has its usage anyway, and no chunk
        plain = client.completions.create(model=SERVED_NAME, prompt="Hello", max_tokens=2)
        assert plain.usage.completion_tokens == 2


def test_load_counts_a_request_until_its_last_byte_or_its_client_leaves(proxied):
    base, _ = proxied
    _until_load(base, 0)
    body = {"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 8000, "ignore_eos": True,
            "stream": True, "temperature": 0.0}
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=60) as response:
        chunks = response.iter_bytes()  # (kept: a dropped iterator closes the connection)
        next(chunks)  # the stream runs
        assert _load(base) == 1
    _until_load(base, 0)  # hung up: the server stopped counting it
    # a refused request is not left counted either
    assert httpx.post(base + "/v1/completions", json={"model": SERVED_NAME, "prompt": "Hi",
                                                       "max_tokens": -1}).status_code == 400
    assert _load(base) == 0


def test_each_request_and_answer_is_logged_clipped(proxied):
    base, log_path = proxied
    prompt = list(range(100, 120))
    answer = httpx.post(base + "/v1/completions", headers={"X-Request-Id": "logged-1"},
                        json={"model": SERVED_NAME, "prompt": prompt, "max_tokens": 9,
                              "temperature": 0.0, "ignore_eos": True}, timeout=60).json()
    lines = log_path.read_text().splitlines()
    received = next(line for line in lines if "Received request cmpl-logged-1" in line)
    assert f"prompt_token_ids: {prompt[:MAX_LOG_LEN]}," in received
    assert "max_tokens=9" in received and "lora_request: None" in received
    generated = next(line for line in lines if "Generated response cmpl-logged-1" in line)
    assert "finish_reason: length" in generated
    assert f"output: {answer['choices'][0]['text'][:MAX_LOG_LEN]!r}," in generated
    ids = generated.split("output_token_ids: ")[1].split("]")[0]
    assert len(ids.split(",")) == MAX_LOG_LEN


def test_the_operator_chooses_the_form_the_template_gets_the_content_in(proxied):
    """openai: every content as a list of parts, a string as one part (auto would give this
    template, which loops over nothing, the strings)."""
    base, _ = proxied
    template = "{% for m in messages %}{{ m['content'] | length }};{% endfor %}"
    messages = [{"role": "user", "content": "abc"},
                {"role": "user", "content": [{"type": "text", "text": "d"},
                                             {"type": "text", "text": "ef"}]}]
    ids = httpx.post(base + "/tokenize", json={"model": SERVED_NAME, "messages": messages,
                                               "chat_template": template}).json()["tokens"]
    text = httpx.post(base + "/detokenize", json={"model": SERVED_NAME, "tokens": ids}).json()
    assert text["prompt"] == "1;2;"
