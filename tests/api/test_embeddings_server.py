"""``/v1/embeddings`` on a real server over a tiny sentence-transformers model, through the
official ``openai`` client, against sentence-transformers itself as the oracle; the refusals
(bad input, the wrong kind of model for a route) in OpenAI's shape; and ``AsyncLLM.embed``
on its own: the oracle's vectors, the metrics it reports, and the abort of a cancelled caller.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import time

import httpx
import numpy as np
import pytest
from api_helpers import openai_client, serving

from actorlm.async_llm import AsyncLLM
from actorlm.pooling import PoolingParams

EMBED_NAME = "tiny-embed"
TEXTS = ["Once upon a time", "The quick brown fox jumps over the lazy dog.",
         "Machine learning models read text as tokens", "1, 2, 3, 42 and 2024"]
ATOL = 1e-4  # float32 on both sides; ~1e-6 in practice


@pytest.fixture(scope="module")
def embedding_model(tiny_embedding_dirs):
    """(directory, oracle): the tiny Qwen3 as a sentence-transformers model (last-token
    pooling, normalized), laid out as users' embedding models are."""
    from sentence_transformers import SentenceTransformer

    path = tiny_embedding_dirs["qwen3_last"]
    return path, SentenceTransformer(str(path), device="cpu")


@pytest.fixture(scope="module")
def oracle(embedding_model):
    """text -> the sentence-transformers vector."""
    _, st = embedding_model
    vectors = st.encode(TEXTS, convert_to_numpy=True)
    return dict(zip(TEXTS, vectors))


@pytest.fixture(scope="module")
def embed_server(embedding_model, tmp_path_factory):
    """(base URL, log file) of ``actorlm serve`` on the embedding model."""
    path, _ = embedding_model
    log_path = tmp_path_factory.mktemp("embed_server") / "server.log"
    with serving(path, log_path, "--num-kv-blocks", "128", "--served-model-name", EMBED_NAME,
                 "--log-stats-interval", "1") as (proc, base):
        yield base, log_path
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def embed_url(embed_server) -> str:
    return embed_server[0]


@pytest.fixture(scope="module")
def embed_client(embed_url):
    with openai_client(embed_url) as client:
        yield client


def _tokens(embedding_model, text: str) -> list[int]:
    return embedding_model[1].tokenizer(text)["input_ids"]


def _post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=60)


def _assert_refused(reply: httpx.Response, param: str | None, words: str) -> None:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param and words in error["message"], error


# --- the oracle's vectors -------------------------------------------------------------------------


@pytest.mark.parametrize("encoding_format", [None, "float"])  # None: the client's base64
def test_embeddings_equal_the_oracle_in_input_order(embed_client, embedding_model, oracle,
                                                    encoding_format):
    extra = {} if encoding_format is None else {"encoding_format": encoding_format}
    reply = embed_client.embeddings.create(model=EMBED_NAME, input=TEXTS, **extra)
    assert reply.object == "list" and reply.model == EMBED_NAME and reply.id.startswith("embd-")
    assert [d.index for d in reply.data] == list(range(len(TEXTS)))
    for text, item in zip(TEXTS, reply.data):
        assert item.object == "embedding"
        np.testing.assert_allclose(np.asarray(item.embedding, np.float32), oracle[text],
                                   atol=ATOL, rtol=0)
    num_tokens = sum(len(_tokens(embedding_model, t)) for t in TEXTS)
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == num_tokens


def test_base64_is_little_endian_float32(embed_url, oracle):
    reply = _post(embed_url, "/v1/embeddings", {"input": TEXTS[0], "encoding_format": "base64"})
    assert reply.status_code == 200, reply.text
    encoded = reply.json()["data"][0]["embedding"]
    assert isinstance(encoded, str)
    vector = np.frombuffer(base64.b64decode(encoded), dtype="<f4")
    np.testing.assert_allclose(vector, oracle[TEXTS[0]], atol=ATOL, rtol=0)


def test_token_id_inputs_equal_their_texts(embed_client, embedding_model, oracle):
    ids = [_tokens(embedding_model, t) for t in TEXTS[:2]]
    several = embed_client.embeddings.create(model=EMBED_NAME, input=ids)
    one = embed_client.embeddings.create(model=EMBED_NAME, input=ids[1])
    vectors = [d.embedding for d in several.data] + [one.data[0].embedding]
    for text, vector in zip([*TEXTS[:2], TEXTS[1]], vectors):
        np.testing.assert_allclose(np.asarray(vector, np.float32), oracle[text], atol=ATOL,
                                   rtol=0)
    assert one.usage.prompt_tokens == len(ids[1])


def test_truncate_prompt_tokens_keeps_the_last_tokens(embed_client, embedding_model):
    ids = _tokens(embedding_model, TEXTS[1])
    cut = embed_client.embeddings.create(model=EMBED_NAME, input=TEXTS[1],
                                         extra_body={"truncate_prompt_tokens": 4})
    tail = embed_client.embeddings.create(model=EMBED_NAME, input=ids[-4:])
    assert cut.usage.prompt_tokens == 4
    np.testing.assert_allclose(cut.data[0].embedding, tail.data[0].embedding, atol=1e-6)


# (a partial answer last, for continue_final_message)
CONVERSATION = [{"role": "system", "content": "You embed things."},
                {"role": "user", "content": "The quick brown fox"},
                {"role": "assistant", "content": "jumps over"}]


def _rendered(embedding_model, **template_kwargs) -> str:
    """The conversation as the model's own chat template renders it (transformers)."""
    return embedding_model[1].tokenizer.apply_chat_template(CONVERSATION, tokenize=False,
                                                            **template_kwargs)


@pytest.mark.parametrize("fields, template_kwargs", [
    ({}, {"add_generation_prompt": False}),
    ({"add_generation_prompt": True}, {"add_generation_prompt": True}),
    ({"continue_final_message": True}, {"continue_final_message": True}),
], ids=["as-is", "generation-prompt", "continue-final-message"])
def test_messages_embed_as_the_chat_template_renders_them(embed_url, embedding_model, fields,
                                                          template_kwargs):
    text = _rendered(embedding_model, **template_kwargs)
    ids = embedding_model[1].tokenizer.apply_chat_template(
        CONVERSATION, tokenize=True, return_dict=True, **template_kwargs)["input_ids"]
    assert _tokens(embedding_model, text) == ids  # (the oracle reads the same tokens)
    reply = _post(embed_url, "/v1/embeddings", {"messages": CONVERSATION, **fields})
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == len(ids)
    np.testing.assert_allclose(np.asarray(reply.json()["data"][0]["embedding"], np.float32),
                               embedding_model[1].encode(text), atol=ATOL, rtol=0)


def test_the_chat_fields_change_the_vector(embed_url):
    def vector(**fields):
        reply = _post(embed_url, "/v1/embeddings", {"messages": CONVERSATION, **fields})
        assert reply.status_code == 200, reply.text
        return np.asarray(reply.json()["data"][0]["embedding"])

    as_is = vector()
    assert not np.allclose(as_is, vector(add_generation_prompt=True), atol=1e-3)
    assert not np.allclose(as_is, vector(continue_final_message=True), atol=1e-3)


def test_pooling_gives_the_embedding_as_data(embed_url, embedding_model, oracle):
    reply = _post(embed_url, "/pooling", {"input": TEXTS[:2]})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["id"].startswith("pool-") and body["object"] == "list"
    assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "pooling"), (1, "pooling")]
    for text, item in zip(TEXTS, body["data"]):
        np.testing.assert_allclose(item["data"], oracle[text], atol=ATOL, rtol=0)
    encoded = _post(embed_url, "/pooling", {"input": TEXTS[0], "encoding_format": "base64",
                                            "task": "embed"}).json()["data"][0]["data"]
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(encoded), dtype="<f4"),
                               oracle[TEXTS[0]], atol=ATOL, rtol=0)
    chat = _post(embed_url, "/pooling", {"messages": CONVERSATION}).json()["data"][0]["data"]
    np.testing.assert_allclose(chat, embedding_model[1].encode(_rendered(embedding_model)),
                               atol=ATOL, rtol=0)


@pytest.mark.parametrize("body, param, words", [
    ({"input": "x", "task": "classify"}, "task", "does embed, not classify"),
    ({"input": "x", "task": "token_embed"}, "task", "token_embed"),
    ({"messages": CONVERSATION, "input": "x"}, "input", "either input or messages"),
], ids=["other-task", "token-task", "input-and-messages"])
def test_pooling_refuses_what_the_model_does_not_do(embed_url, body, param, words):
    _assert_refused(_post(embed_url, "/pooling", body), param, words)


def test_embeddings_are_counted_in_the_metrics(embed_client, embed_url):
    embed_client.embeddings.create(model=EMBED_NAME, input=TEXTS[0])
    metrics = httpx.get(embed_url + "/metrics").text
    finished = [line for line in metrics.splitlines()
                if line.startswith("vllm:request_success_total") and 'reason="stop"' in line]
    assert finished and float(finished[0].split()[-1]) >= 1
    assert "vllm:num_requests_running" in metrics


def test_a_client_that_hangs_up_aborts_every_input(embed_server):
    base, log_path = embed_server
    # long enough to be running when the client goes (no two share a cached prefix)
    many = [[5 + (i + 7 * j) % 390 for j in range(500)] for i in range(256)]
    body = json.dumps({"input": many}).encode()
    host = base.removeprefix("http://")
    head = (f"POST /v1/embeddings HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    address, port = host.split(":")
    with socket.create_connection((address, int(port))) as sock:
        sock.sendall(head + body)
        _wait_for(lambda: _num_running(base) > 0, "the inputs to run")
    _wait_for(lambda: "client disconnected; aborted" in log_path.read_text(), "the abort")
    _wait_for(lambda: _num_running(base) == 0, "the engine to be idle")
    assert 'reason="abort"' in httpx.get(base + "/metrics").text


def _num_running(base: str) -> float:
    metrics = httpx.get(base + "/metrics").text
    return float(next(line for line in metrics.splitlines()
                      if line.startswith("vllm:num_requests_running")).split()[-1])


def _wait_for(condition, what: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"waited {within} s for {what}"
        time.sleep(0.01)


# --- refusals -------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param, words", [
    ({"input": []}, "input", "empty"),
    ({"input": ""}, "input", "empty"),
    ({"input": [[]]}, "input", "empty"),
    ({"input": [1, "x"]}, "input", "expected a string"),
    ({"input": [[1], "x"]}, "input", "expected a string"),
    ({"input": [True]}, "input", "expected a string"),
    ({"input": [10**6]}, "input", "outside the vocabulary"),
    ({"input": "x", "dimensions": 0}, "dimensions", "positive integer"),
    ({"input": "x", "dimensions": 32}, "dimensions", "matryoshka"),
    ({"input": "x", "dimensions": "32"}, "dimensions", "Expected `int | null`"),
    ({"input": "x", "dimensions": 10**30}, "dimensions", ""),
    ({"input": "x", "encoding_format": "bytes"}, "encoding_format", "Invalid enum value"),
    ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "must be -1"),
    ({}, "input", "either input or messages"),
    ({"input": "x", "messages": CONVERSATION}, "input", "either input or messages"),
    ({"messages": []}, "messages", "empty"),
    ({"messages": CONVERSATION, "add_special_tokens": True}, "add_special_tokens",
     "chat template's special tokens"),
    ({"messages": CONVERSATION, "continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message", "add_generation_prompt"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content", "only text parts"),
    ({"messages": CONVERSATION, "chat_template": "{{ messages }}"}, "chat_template",
     "--trust-request-chat-template"),
], ids=["empty-list", "empty-text", "empty-ids", "mixed", "ids-and-text", "bool",
        "outside-vocab", "dimensions-0", "dimensions-not-matryoshka", "dimensions-text",
        "dimensions-huge", "encoding-format", "truncate-0", "no-input", "input-and-messages",
        "no-messages", "special-tokens-on-messages", "continue-and-generation-prompt",
        "image-part", "untrusted-template"])
def test_bad_input_is_a_400_naming_the_field(embed_url, body, param, words):
    _assert_refused(_post(embed_url, "/v1/embeddings", body), param, words)
    assert _post(embed_url, "/v1/embeddings", {"input": TEXTS[0]}).status_code == 200


def test_an_unknown_model_is_a_404_as_on_every_route(embed_url):
    reply = _post(embed_url, "/v1/embeddings", {"input": "x", "model": "gpt-17"})
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "model"


def test_unknown_fields_are_ignored_and_logged_as_elsewhere(embed_server):
    base, log_path = embed_server
    reply = _post(base, "/v1/embeddings", {"input": TEXTS[0], "embedding_colour": "blue",
                                           "user": "someone"})
    assert reply.status_code == 200, reply.text
    _wait_for(lambda: "unknown field 'embedding_colour'" in log_path.read_text(), "the log")


def test_generation_routes_refuse_a_pooling_model(embed_url):
    _assert_refused(_post(embed_url, "/v1/completions", {"prompt": "x"}), None,
                    "The model does not support Completions API")
    _assert_refused(_post(embed_url, "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "x"}]}), None,
                    "The model does not support Chat Completions API")


def test_embeddings_refuse_a_generating_model(server):
    _assert_refused(_post(server, "/v1/embeddings", {"input": "x"}), None,
                    "The model does not support Embeddings API")
    _assert_refused(_post(server, "/pooling", {"input": "x"}), None,
                    "The model does not support Pooling API")


def test_openapi_lists_the_route(embed_url):
    document = httpx.get(embed_url + "/openapi.json").json()
    operation = document["paths"]["/v1/embeddings"]["post"]
    schema = operation["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert schema.endswith("/EmbeddingRequest")
    assert {"input", "messages"} <= set(
        document["components"]["schemas"]["EmbeddingRequest"]["properties"])


# --- AsyncLLM.embed on its own --------------------------------------------------------------------


class _Listener:
    """What ``AsyncLLM`` tells the server's metrics."""

    def __init__(self):
        self.finished: list[str] = []
        self.num_prompt_tokens = self.num_generation_tokens = 0

    def on_request_added(self, num_prompt_tokens):
        self.num_prompt_tokens += num_prompt_tokens

    def observe_first_token(self, seconds):
        raise AssertionError("an embedding generates no token")

    observe_inter_token = observe_first_token

    def add_generation_tokens(self, num_tokens):
        self.num_generation_tokens += num_tokens

    def observe_finished(self, reason, e2e_seconds, tpot_seconds):
        assert tpot_seconds is None
        self.finished.append(reason)


@pytest.fixture(scope="module")
def async_embedder(embedding_model):
    llm = AsyncLLM(str(embedding_model[0]), dtype="float32", num_kv_blocks=64)
    yield llm
    llm.shutdown()


def test_async_embed_equals_the_oracle_and_reports_its_end(async_embedder, embedding_model,
                                                           oracle):
    listener = async_embedder.stats_listener = _Listener()
    try:
        outputs = asyncio.run(_gather(async_embedder.embed(t) for t in TEXTS))
    finally:
        async_embedder.stats_listener = None
    for text, out in zip(TEXTS, outputs):
        assert out.finished and out.error is None
        assert out.prompt_token_ids == _tokens(embedding_model, text)
        np.testing.assert_allclose(out.outputs.embedding, oracle[text], atol=ATOL, rtol=0)
    assert listener.finished == ["stop"] * len(TEXTS)
    assert listener.num_prompt_tokens == sum(len(o.prompt_token_ids) for o in outputs)
    assert listener.num_generation_tokens == 0 and not async_embedder._live


def test_async_embed_refuses_what_the_model_cannot_do(async_embedder):
    with pytest.raises(ValueError, match="dimensions: the model does not support matryoshka"):
        asyncio.run(async_embedder.embed("x", PoolingParams(dimensions=8)))
    with pytest.raises(ValueError, match="this model runs for embeddings"):
        asyncio.run(async_embedder.add_request("gen-0", "x"))


def test_a_cancelled_embed_aborts_its_request(async_embedder):
    long_prompt = list(range(10, 200)) * 2
    listener = async_embedder.stats_listener = _Listener()

    async def main() -> list[bool]:
        tasks = [asyncio.ensure_future(async_embedder.embed(long_prompt)) for _ in range(8)]
        while not async_embedder._live:  # one is in the engine, and its caller still waits
            await asyncio.sleep(0.001)
        cancelled = [task.cancel() for task in tasks]
        await asyncio.gather(*tasks, return_exceptions=True)
        return cancelled

    try:
        assert any(asyncio.run(main()))
    finally:
        async_embedder.stats_listener = None
    assert "abort" in listener.finished

    def idle() -> bool:  # the aborted requests leave nothing behind
        stats = async_embedder.stats()
        return stats["num_running"] == stats["num_waiting"] == 0 and not async_embedder._live \
            and stats["num_free_blocks"] == stats["num_total_blocks"]

    _wait_for(idle, "the engine to be idle")


async def _gather(coroutines):
    return await asyncio.gather(*coroutines)
