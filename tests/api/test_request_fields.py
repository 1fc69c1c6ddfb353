"""Fields beyond OpenAI's core: truncation works, "off" values pass, unknown names are logged
once, and a trusted server runs a request's own chat template."""

from __future__ import annotations

import httpx
import pytest
from api_helpers import SERVED_NAME, running

from actorlm.api.options import ServerOptions, read_chat_template
from actorlm.api.server import create_app
from actorlm.async_llm import AsyncLLM

GREEDY = {"model": SERVED_NAME, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
HI = [{"role": "user", "content": "Once upon a time there was a baker"}]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


def _ok(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    return response.json()


def test_truncate_prompt_tokens_keeps_the_last_tokens(http):
    prompt = "The quick brown fox jumps over the lazy dog. A journey of a thousand miles"
    ids = _ok(http.post("/tokenize", json={"prompt": prompt}))["tokens"]
    assert len(ids) > 12
    truncated = _ok(http.post("/v1/completions",
                              json={**GREEDY, "prompt": ids, "truncate_prompt_tokens": 7}))
    tail = _ok(http.post("/v1/completions", json={**GREEDY, "prompt": ids[-7:]}))
    assert truncated["usage"]["prompt_tokens"] == 7
    assert truncated["choices"][0]["text"] == tail["choices"][0]["text"]
    # -1: as much as the context holds (512 here): the whole of this prompt
    whole = _ok(http.post("/v1/completions",
                          json={**GREEDY, "prompt": ids, "truncate_prompt_tokens": -1}))
    assert whole["usage"]["prompt_tokens"] == len(ids)
    # vLLM's truncation_side "right": the first 7 instead
    head = _ok(http.post("/v1/completions", json={**GREEDY, "prompt": ids[:7]}))
    first = _ok(http.post("/v1/completions", json={
        **GREEDY, "prompt": ids, "truncate_prompt_tokens": 7, "truncation_side": "right"}))
    assert first["usage"]["prompt_tokens"] == 7
    assert first["choices"][0]["text"] == head["choices"][0]["text"] != \
        truncated["choices"][0]["text"]
    wrong = http.post("/v1/completions", json={**GREEDY, "prompt": ids, "truncation_side": "up"})
    assert wrong.status_code == 400 and "truncation_side" in wrong.text


def test_truncate_prompt_tokens_in_chat(http):
    full = _ok(http.post("/v1/chat/completions", json={**GREEDY, "messages": HI}))
    cut = _ok(http.post("/v1/chat/completions",
                        json={**GREEDY, "messages": HI, "truncate_prompt_tokens": 5}))
    assert full["usage"]["prompt_tokens"] > 5 and cut["usage"]["prompt_tokens"] == 5


def test_continue_final_message_leaves_the_last_message_open(http, tiny_llama_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    messages = [*HI, {"role": "assistant", "content": "who baked"}]

    def rendered(**kwargs) -> list[int]:
        return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                             **kwargs)["input_ids"]

    open_ids = rendered(continue_final_message=True)
    assert open_ids != rendered(add_generation_prompt=False)  # the turn's end is left off
    fields = {"messages": messages, "add_generation_prompt": False,
              "continue_final_message": True}
    assert _ok(http.post("/tokenize", json=fields))["tokens"] == open_ids
    chat = _ok(http.post("/v1/chat/completions", json={**GREEDY, **fields}))
    assert chat["usage"]["prompt_tokens"] == len(open_ids)
    completion = _ok(http.post("/v1/completions", json={**GREEDY, "prompt": open_ids}))
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]
    # the generation prompt (on by default in chat) and an open last message exclude each other
    both = http.post("/v1/chat/completions", json={**GREEDY, "messages": messages,
                                                   "continue_final_message": True})
    assert both.status_code == 400
    assert both.json()["error"]["param"] == "continue_final_message"


def test_a_cache_salt_keeps_a_tenants_cached_prefix_to_itself(http):
    import random

    ids = random.Random("salt").sample(range(10, 250), 40)  # a prompt no other test sends

    def cached(**salt):
        body = {**GREEDY, "prompt": ids, **salt}
        return _ok(http.post("/v1/completions", json=body))["usage"]["prompt_tokens_details"][
            "cached_tokens"]

    assert cached(cache_salt="tenant-a") == 0
    assert cached(cache_salt="tenant-b") == 0 and cached() == 0  # nobody else sees a's blocks
    assert cached(cache_salt="tenant-a") > 0
    refused = http.post("/v1/completions", json={**GREEDY, "prompt": ids, "cache_salt": ""})
    assert refused.status_code == 400 and "cache_salt" in refused.json()["error"]["message"]


OFF_VALUES = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
              "guided_json": None, "guided_choice": [], "structured_outputs": None,
              "use_beam_search": False, "priority": 0, "logits_processors": [],
              "chat_template_kwargs": {"enable_thinking": False}, "thinking_token_budget": None,
              "kv_transfer_params": None, "echo": False, "watermarking": False}


def test_unimplemented_fields_pass_when_off(http):
    plain = _ok(http.post("/v1/chat/completions", json={**GREEDY, "messages": HI}))
    off = _ok(http.post("/v1/chat/completions", json={**GREEDY, "messages": HI, **OFF_VALUES}))
    assert off["choices"][0]["message"] == plain["choices"][0]["message"]


def test_unknown_fields_are_ignored_and_logged_once(http, server_process):
    _, log_path = server_process
    body = {**GREEDY, "prompt": "Once upon a time", "tempreature": 1.5, "x_custom_field_7": 1}
    answers = [_ok(http.post("/v1/completions", json=body)) for _ in range(3)]
    plain = _ok(http.post("/v1/completions", json={**GREEDY, "prompt": "Once upon a time"}))
    assert {a["choices"][0]["text"] for a in answers} == {plain["choices"][0]["text"]}
    text = log_path.read_text()
    assert text.count("unknown field 'tempreature'") == 1
    assert text.count("unknown field 'x_custom_field_7'") == 1


def test_trusted_server_runs_a_request_template(tiny_llama_dir):
    engine = AsyncLLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    try:
        options = ServerOptions(trust_request_chat_template=True)
        with running(create_app(engine, options=options, served_model_name=SERVED_NAME)) as base:
            body = {**GREEDY, "messages": HI, "max_tokens": 1}
            own = httpx.post(base + "/v1/chat/completions", timeout=30,
                             json={**body, "chat_template": template})
            expected = engine.encode("[" + HI[0]["content"] + "]", add_special_tokens=False)
            assert _ok(own)["usage"]["prompt_tokens"] == len(expected)
            # whatever the template raises is the client's 400
            for bad in ("{{ 1/0 }}", "{% for %}", "{{ messages[99]['content'] }}x{{ raise }}"):
                error = httpx.post(base + "/v1/chat/completions", timeout=30,
                                   json={**body, "chat_template": bad})
                assert error.status_code == 400, error.text
                assert "chat template failed" in error.json()["error"]["message"]
            # still no overriding it through the kwargs
            kwargs = httpx.post(base + "/v1/chat/completions", timeout=30,
                                json={**body, "chat_template_kwargs": {"chat_template": template}})
            assert kwargs.status_code == 400
    finally:
        engine.shutdown()


def test_reasoning_effort_is_the_chat_templates_variable(tiny_llama_dir):
    """OpenAI's ``reasoning_effort`` (chat) and ``reasoning.effort`` (Responses) reach the
    template as vLLM passes them, a variable of that name; a value OpenAI does not define is
    a 400 naming the field."""
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}{{ reasoning_effort }}"
    engine = AsyncLLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    try:
        options = ServerOptions(chat_template=template)
        with running(create_app(engine, options=options, served_model_name=SERVED_NAME)) as base:
            def rendered(effort: str) -> int:
                return len(engine.encode(f"<{HI[0]['content']}>{effort}",
                                         add_special_tokens=False))

            body = {**GREEDY, "messages": HI, "max_tokens": 1}
            chat = _ok(httpx.post(base + "/v1/chat/completions", timeout=30,
                                  json={**body, "reasoning_effort": "high"}))
            assert chat["usage"]["prompt_tokens"] == rendered("high") != rendered("")
            response = _ok(httpx.post(base + "/v1/responses", timeout=30, json={
                "input": HI[0]["content"], "max_output_tokens": 1,
                "reasoning": {"effort": "minimal", "summary": None}}))
            assert response["usage"]["input_tokens"] == rendered("minimal")
            bad = httpx.post(base + "/v1/chat/completions", timeout=30,
                             json={**body, "reasoning_effort": "extreme"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
    finally:
        engine.shutdown()


def test_the_servers_chat_template_takes_the_models_place(tiny_llama_dir, tmp_path):
    """``--chat-template``: chat, /tokenize and the Responses API render with the server's
    template; a request's own stays refused unless trusted; a missing file or a broken
    template stops the start with the flag named."""
    template = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert read_chat_template(str(tmp_path / "t.jinja")) == template
    assert read_chat_template(template) == template
    with pytest.raises(ValueError, match="--chat-template: .*neither a file nor a Jinja"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="--chat-template: not a valid Jinja template"):
        ServerOptions(chat_template="{% for m in messages %}")
    engine = AsyncLLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    try:
        options = ServerOptions(chat_template=template)
        with running(create_app(engine, options=options, served_model_name=SERVED_NAME)) as base:
            expected = engine.encode("<" + HI[0]["content"] + ">", add_special_tokens=False)
            body = {**GREEDY, "messages": HI, "max_tokens": 1}
            chat = _ok(httpx.post(base + "/v1/chat/completions", json=body, timeout=30))
            assert chat["usage"]["prompt_tokens"] == len(expected)
            tokens = _ok(httpx.post(base + "/tokenize", json={"messages": HI}, timeout=30))
            assert tokens["tokens"] == expected
            response = _ok(httpx.post(base + "/v1/responses", timeout=30, json={
                "input": HI[0]["content"], "max_output_tokens": 1}))
            assert response["usage"]["input_tokens"] == len(expected)
            own = httpx.post(base + "/v1/chat/completions", timeout=30,
                             json={**body, "chat_template": "{{ 'x' }}"})
            assert own.status_code == 400 and own.json()["error"]["param"] == "chat_template"
    finally:
        engine.shutdown()


def test_the_base_model_answers_to_each_of_its_served_names(tiny_llama_dir):
    """vLLM's --served-model-name with several names: /v1/models lists each, a request may
    name any, and answers carry the first; any other name is a 404."""
    engine = AsyncLLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64)
    try:
        with running(create_app(engine, served_model_name=["main", "alias"])) as base:
            listed = _ok(httpx.get(base + "/v1/models", timeout=30))["data"]
            assert [card["id"] for card in listed] == ["main", "alias"]
            body = {**GREEDY, "messages": HI}
            answer = _ok(httpx.post(base + "/v1/chat/completions", timeout=30,
                                    json={**body, "model": "alias"}))
            assert answer["model"] == "main"
            other = httpx.post(base + "/v1/chat/completions", timeout=30,
                               json={**body, "model": "other"})
            assert other.status_code == 404 and other.json()["error"]["param"] == "model"
    finally:
        engine.shutdown()


def test_sagemakers_routes_answer_as_the_api_each_body_belongs_to(server):
    """/invocations: a chat body is answered as chat, a prompt as completions, anything else
    is a 400 saying what it takes; /ping is /health, by GET or POST."""
    chat = _ok(httpx.post(server + "/invocations", timeout=30, json={**GREEDY, "messages": HI}))
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"]
    text = _ok(httpx.post(server + "/invocations", timeout=30,
                          json={**GREEDY, "prompt": "Once upon a time"}))
    assert text["object"] == "text_completion"
    for body in ({"foo": 1}, [1, 2]):
        neither = httpx.post(server + "/invocations", timeout=30, json=body)
        assert neither.status_code == 400 and "messages" in neither.json()["error"]["message"]
    assert httpx.get(server + "/ping", timeout=30).status_code == 200
    assert httpx.post(server + "/ping", timeout=30).status_code == 200
