"""``actorlm chat`` and ``actorlm complete`` (vLLM's ``vllm chat`` / ``vllm complete``) against a
real server whose defaults are greedy: what they print is the answer the official client gets
for the same conversation, one message (``-q``) or a typed session that keeps its history."""

from __future__ import annotations

import builtins

import pytest
from api_helpers import SERVED_NAME, openai_client, serving

from actorlm.api.cli import main

GREEDY_DEFAULTS = '{"temperature": 0.0, "max_new_tokens": 6}'


@pytest.fixture(scope="module")
def greedy_server(tiny_llama_dir, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("greedy") / "server.log"
    with serving(tiny_llama_dir, log_path, "--served-model-name", SERVED_NAME,
                 "--override-generation-config", GREEDY_DEFAULTS, "--num-kv-blocks", "256") \
            as (proc, base):
        yield base
        proc.terminate()
        proc.wait(timeout=20)


def _chat_answer(base: str, messages: list[dict]) -> str:
    with openai_client(base) as client:
        return client.chat.completions.create(model=SERVED_NAME,
                                              messages=messages).choices[0].message.content


def test_a_quick_chat_and_completion_print_the_servers_answers(greedy_server, capsys):
    assert main(["chat", "--url", greedy_server + "/v1", "--system-prompt", "Be brief.",
                 "-q", "Hi"]) == 0
    expected = _chat_answer(greedy_server, [{"role": "system", "content": "Be brief."},
                                            {"role": "user", "content": "Hi"}])
    assert capsys.readouterr().out == expected + "\n"
    assert main(["complete", "--url", greedy_server + "/v1", "--max-tokens", "4",
                 "-q", "Once upon"]) == 0
    with openai_client(greedy_server) as client:
        completion = client.completions.create(model=SERVED_NAME, prompt="Once upon",
                                               max_tokens=4).choices[0].text
    assert capsys.readouterr().out == completion + "\n"


def test_a_typed_chat_keeps_the_conversation(greedy_server, capsys, monkeypatch):
    typed = iter(["Hi", "And then?"])

    def type_line(prompt):
        try:
            return next(typed)
        except StopIteration:
            raise EOFError from None

    monkeypatch.setattr(builtins, "input", type_line)
    assert main(["chat", "--url", greedy_server + "/v1", "--model-name", SERVED_NAME]) == 0
    first = _chat_answer(greedy_server, [{"role": "user", "content": "Hi"}])
    second = _chat_answer(greedy_server, [{"role": "user", "content": "Hi"},
                                          {"role": "assistant", "content": first},
                                          {"role": "user", "content": "And then?"}])
    assert capsys.readouterr().out == \
        f"Please enter a message for the chat model:\n{first}\n{second}\n\n"


def test_no_server_is_a_clear_error(capsys):
    assert main(["complete", "--url", "http://127.0.0.1:9/v1", "-q", "x"]) == 2
    assert "no server answers at http://127.0.0.1:9/v1" in capsys.readouterr().err
