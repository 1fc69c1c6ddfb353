"""Background responses (OpenAI's ``background: true``) through the official ``openai``
client: answered at once, queued; retrieved while they run and once they end, with the answer
a foreground response gives; cancelled while running (their request aborted, the engine left
idle), and refused where OpenAI refuses them."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from api_helpers import SERVED_NAME, openai_client, serving

QUESTION = "Tell me about the village and the baker."


@pytest.fixture(scope="module")
def server(tiny_llama_long_dir, tmp_path_factory):
    """A server on a model whose requests may outlive a few seconds (8,192 positions)."""
    log_path = tmp_path_factory.mktemp("background") / "server.log"
    with serving(tiny_llama_long_dir, log_path, "--served-model-name", SERVED_NAME,
                 "--num-kv-blocks", "1024") as (proc, base):
        yield base
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def client(server):
    with openai_client(server) as c:
        yield c


def _until_done(client, response_id: str):
    deadline = time.monotonic() + 60
    while (response := client.responses.retrieve(response_id)).status in ("queued",
                                                                          "in_progress"):
        assert time.monotonic() < deadline, f"still {response.status}"
        time.sleep(0.05)
    return response


def _running(server) -> int:
    metrics = httpx.get(server + "/metrics", timeout=10).text
    line = next(line for line in metrics.splitlines()
                if line.startswith("vllm:num_requests_running{"))
    return int(float(line.rsplit(" ", 1)[1]))


def test_a_background_response_is_queued_at_once_and_ends_as_a_foreground_one(client):
    kw = dict(model=SERVED_NAME, input=QUESTION, temperature=0.0, max_output_tokens=16)
    queued = client.responses.create(background=True, **kw)
    assert queued.status == "queued" and queued.background and queued.output == []
    done = _until_done(client, queued.id)
    foreground = client.responses.create(**kw)
    assert done.status == foreground.status == "incomplete"
    assert done.output_text == foreground.output_text and done.output_text
    assert done.usage.output_tokens == 16
    # a stored response like any other: it continues a conversation
    follow = client.responses.create(previous_response_id=queued.id, input="And then?",
                                     temperature=0.0, max_output_tokens=4, model=SERVED_NAME)
    assert follow.status == "incomplete"


def test_a_running_background_response_is_cancelled_and_its_request_aborted(server, client):
    queued = client.responses.create(model=SERVED_NAME, input=QUESTION, background=True,
                                     max_output_tokens=8000, temperature=0.0)
    deadline = time.monotonic() + 30
    while _running(server) == 0:  # (it runs)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(queued.id).status == "cancelled"
    deadline = time.monotonic() + 30
    while _running(server) != 0:  # the engine stopped working on it
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with pytest.raises(openai.BadRequestError, match="already cancelled"):
        client.responses.cancel(queued.id)


@pytest.mark.parametrize("fields, said", [
    ({"background": True, "stream": True}, "is not streamed here"),
    ({"background": True, "store": False}, "must be stored")])
def test_what_a_background_response_cannot_be_is_a_400(server, fields, said):
    answer = httpx.post(server + "/v1/responses", timeout=60,
                        json={"model": SERVED_NAME, "input": QUESTION, **fields})
    assert answer.status_code == 400 and said in answer.json()["error"]["message"]
    assert answer.json()["error"]["param"] == "background"


def test_only_a_background_response_is_cancelled(client):
    foreground = client.responses.create(model=SERVED_NAME, input=QUESTION, max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="only a background response"):
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_unknown")
