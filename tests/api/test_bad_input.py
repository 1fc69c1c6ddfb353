"""Bad input gets the right status and OpenAI's error shape, and leaves the server serving."""

from __future__ import annotations

import json

import httpx
import pytest
from api_helpers import SERVED_NAME

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
OK_MESSAGES = [{"role": "user", "content": "Hello"}]
LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 60  # > 512 tokens
DEEP = b"[" * 100_000 + b"]" * 100_000
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _cmpl(**fields):
    return {"model": SERVED_NAME, "prompt": "Once upon a time", "max_tokens": 4, **fields}


def _chat(**fields):
    return {"model": SERVED_NAME, "messages": OK_MESSAGES, "max_tokens": 4, **fields}


# (id, method, path, body: dict | bytes | None, status, param or None, substring of the message)
CASES = [
    ("malformed-json", "POST", CMPL, b'{"prompt": "x",', 400, None, "JSON"),
    ("not-an-object", "POST", CMPL, b"[1, 2, 3]", 400, None, "object"),
    ("empty-body", "POST", CHAT, b"", 400, None, "empty"),
    ("prompt-wrong-type", "POST", CMPL, _cmpl(prompt=5), 400, "prompt", ""),
    ("prompt-missing", "POST", CMPL, {"model": SERVED_NAME}, 400, "prompt", "prompt"),
    ("max-tokens-string", "POST", CMPL, _cmpl(max_tokens="ten"), 400, "max_tokens", "int"),
    ("max-tokens-negative", "POST", CMPL, _cmpl(max_tokens=-5), 400, "max_tokens", ""),
    ("max-tokens-zero", "POST", CHAT, _chat(max_tokens=0), 400, "max_tokens", ""),
    ("prompt-too-long", "POST", CMPL, _cmpl(prompt=LONG_PROMPT), 400, None,
     "maximum context length is 512 tokens"),
    ("prompt-plus-completion-too-long", "POST", CMPL, _cmpl(max_tokens=600), 400, None,
     "Please reduce the length of the messages or completion"),
    ("chat-too-long", "POST", CHAT, _chat(max_completion_tokens=1000), 400, None,
     "maximum context length is 512 tokens"),
    ("unknown-model", "POST", CMPL, _cmpl(model="gpt-17"), 404, "model", "does not exist"),
    ("unknown-model-chat", "POST", CHAT, _chat(model="gpt-17"), 404, "model", "gpt-17"),
    ("temperature-huge", "POST", CMPL, _cmpl(temperature=5e9), 400, "temperature", ""),
    ("temperature-negative", "POST", CHAT, _chat(temperature=-1), 400, "temperature", ""),
    ("top-p-zero", "POST", CMPL, _cmpl(top_p=0), 400, "top_p", ""),
    ("top-p-above-one", "POST", CHAT, _chat(top_p=1.5), 400, "top_p", ""),
    ("n-zero", "POST", CMPL, _cmpl(n=0), 400, "n", ""),
    ("n-string", "POST", CHAT, _chat(n="two"), 400, "n", ""),
    ("messages-empty", "POST", CHAT, _chat(messages=[]), 400, "messages", "empty"),
    ("messages-not-list", "POST", CHAT, _chat(messages="hi"), 400, "messages", ""),
    ("message-without-role", "POST", CHAT, _chat(messages=[{"content": "hi"}]), 400, None,
     "role"),
    ("message-content-int", "POST", CHAT, _chat(messages=[{"role": "user", "content": 3}]), 400,
     None, "content"),
    ("content-image-part", "POST", CHAT, _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), 400, None, "text"),
    ("stop-wrong-type", "POST", CMPL, _cmpl(stop=5), 400, "stop", ""),
    ("stop-empty-string", "POST", CMPL, _cmpl(stop=[""]), 400, "stop", ""),
    ("logprobs-too-many", "POST", CMPL, _cmpl(logprobs=50), 400, "logprobs", ""),
    ("top-logprobs-too-many", "POST", CHAT, _chat(logprobs=True, top_logprobs=30), 400,
     "top_logprobs", ""),
    ("top-logprobs-without-logprobs", "POST", CHAT, _chat(top_logprobs=2), 400, "top_logprobs",
     "logprobs"),
    ("presence-penalty-range", "POST", CMPL, _cmpl(presence_penalty=3), 400, "presence_penalty",
     ""),
    ("frequency-penalty-range", "POST", CHAT, _chat(frequency_penalty=-3), 400,
     "frequency_penalty", ""),
    ("repetition-penalty-zero", "POST", CMPL, _cmpl(repetition_penalty=0), 400,
     "repetition_penalty", ""),
    ("top-k-negative", "POST", CMPL, _cmpl(top_k=-5), 400, "top_k", ""),
    ("min-p-above-one", "POST", CMPL, _cmpl(min_p=2), 400, "min_p", ""),
    ("logit-bias-bad-key", "POST", CMPL, _cmpl(logit_bias={"abc": 1}), 400, "logit_bias", ""),
    ("logit-bias-out-of-range", "POST", CMPL, _cmpl(logit_bias={"5": 500}), 400, "logit_bias", ""),
    ("logit-bias-out-of-vocab", "POST", CMPL, _cmpl(logit_bias={"99999": 1}), 400, "logit_bias",
     "vocabulary"),
    ("prompt-ids-out-of-vocab", "POST", CMPL, _cmpl(prompt=[1, 99999]), 400, "prompt",
     "vocabulary"),
    ("prompt-empty", "POST", CMPL, _cmpl(prompt=""), 400, "prompt", "empty"),
    ("prompt-list-empty", "POST", CMPL, _cmpl(prompt=[]), 400, "prompt", "empty"),
    ("prompt-list-mixed", "POST", CMPL, _cmpl(prompt=[1, "a"]), 400, "prompt", ""),
    ("stream-options-without-stream", "POST", CMPL,
     _cmpl(stream_options={"include_usage": True}), 400, "stream_options", ""),
    ("min-tokens-above-max", "POST", CMPL, _cmpl(min_tokens=10), 400, "min_tokens", ""),
    ("stop-token-ids-negative", "POST", CMPL, _cmpl(stop_token_ids=[-1]), 400, "stop_token_ids",
     ""),
    ("seed-string", "POST", CMPL, _cmpl(seed="abc"), 400, "seed", ""),
    ("stream-not-bool", "POST", CHAT, _chat(stream="yes"), 400, "stream", ""),
    ("prompt-logprobs-streaming", "POST", CMPL, _cmpl(prompt_logprobs=1, stream=True), 400,
     "prompt_logprobs", "stream"),
    ("echo-logprobs-streaming", "POST", CMPL, _cmpl(echo=True, logprobs=1, stream=True), 400,
     "echo", "streaming"),
    ("suffix-unsupported", "POST", CMPL, _cmpl(suffix="x"), 400, "suffix", ""),
    ("get-on-post-route", "GET", CMPL, None, 405, None, ""),
    ("unknown-route", "GET", "/v1/nothing", None, 404, None, ""),
    ("detokenize-out-of-vocab", "POST", "/detokenize", {"tokens": [99999]}, 400, "tokens", ""),
    ("tokenize-nothing", "POST", "/tokenize", {"model": SERVED_NAME}, 400, None, "prompt"),
    # constraints on the output: malformed, contradictory or unparseable ones are the client's
    ("response-format-bogus", "POST", CMPL, _cmpl(response_format={"type": "bogus"}), 400,
     "response_format.type", "bogus"),
    ("response-format-no-schema", "POST", CHAT, _chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x"}}), 400, "response_format",
     "schema is required"),
    ("response-format-bad-schema", "POST", CHAT, _chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}), 400,
     "response_format", "not a valid JSON Schema"),
    ("structural-tag-empty", "POST", CHAT, _chat(response_format={"type": "structural_tag"}),
     400, "response_format", "needs its format"),
    ("structural-tag-no-end", "POST", CMPL, _cmpl(response_format={
        "type": "structural_tag", "structures": [{"begin": "<f>", "schema": {}}],
        "triggers": ["<f"]}), 400, "response_format", "needs a begin, a schema and an end"),
    ("structural-tag-empty-text", "POST", CMPL, _cmpl(structured_outputs={
        "structural_tag": ""}), 400, "structured_outputs", "must not be empty"),
    ("structural-tag-unknown-format", "POST", CMPL, _cmpl(structured_outputs={
        "structural_tag": {"type": "structural_tag", "format": {"type": "nonsense"}}}), 400,
     "structured_outputs", "nonsense"),
    ("schema-xgrammar-refuses", "POST", CMPL, _cmpl(guided_json={
        "type": "integer", "minimum": 5, "maximum": 1}), 400, "guided_json", "minimum"),
    ("guided-regex-unclosed", "POST", CMPL, _cmpl(guided_regex="(a"), 400, "guided_regex",
     "parenthesis"),
    ("guided-grammar-no-root", "POST", CHAT, _chat(guided_grammar='start ::= "a"'), 400,
     "guided_grammar", "root"),
    ("guided-choice-empty-string", "POST", CHAT, _chat(guided_choice=["yes", ""]), 400,
     "guided_choice", "non-empty"),
    ("two-constraints", "POST", CMPL, _cmpl(guided_regex="a", structured_outputs={
        "choice": ["b"]}), 400, "guided_regex", "not several"),
    ("structured-outputs-two-kinds", "POST", CHAT, _chat(structured_outputs={
        "regex": "a", "choice": ["b"]}), 400, "structured_outputs", "exactly one"),
    ("structured-outputs-unknown-key", "POST", CHAT, _chat(structured_outputs={
        "whitespace_pattern": " "}), 400, "structured_outputs", "whitespace_pattern"),
    ("other-grammar-backend", "POST", CMPL, _cmpl(guided_decoding_backend="outlines"), 400,
     "guided_decoding_backend", "xgrammar"),
    # tools: auto needs the operator's parser; a choice must name a tool the request has
    ("tools-auto-without-parser", "POST", CHAT, _chat(tools=[TOOL]), 400, "tool_choice",
     "--enable-auto-tool-choice"),
    ("tool-choice-without-tools", "POST", CHAT, _chat(tool_choice="required"), 400,
     "tool_choice", "tools must be given"),
    ("tool-choice-unknown-function", "POST", CHAT, _chat(tools=[TOOL], tool_choice={
        "type": "function", "function": {"name": "g"}}), 400, "tool_choice", "'g'"),
    ("tool-choice-bogus", "POST", CHAT, _chat(tools=[TOOL], tool_choice="always"), 400,
     "tool_choice", ""),
    ("tool-name-with-space", "POST", CHAT, _chat(tools=[{"type": "function", "function": {
        "name": "get weather"}}], tool_choice="required"), 400, None, "tools"),
    ("tool-parameters-bad-schema", "POST", CHAT, _chat(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "required": 3}}}], tool_choice="required"),
     400, "tools", "not a valid JSON Schema"),
    ("tool-call-and-response-format", "POST", CHAT, _chat(tools=[TOOL], tool_choice="required",
                                                          response_format={"type": "json_object"}),
     400, "tool_choice", "cannot be combined"),
    ("tool-call-arguments-not-json", "POST", CHAT, _chat(messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "f", "arguments": "{oops"}}]}]), 400,
     "messages[1].tool_calls[0].function.arguments", "JSON object"),
    ("functions-deprecated", "POST", CHAT, _chat(functions=[{"name": "f"}]), 400, "functions",
     "not supported"),
    # fields vLLM defines and actorlm does not implement: refused, not dropped
    ("logits-processors", "POST", CMPL, _cmpl(logits_processors=["x"]), 400,
     "logits_processors", "not supported"),
    ("thinking-token-budget", "POST", CHAT, _chat(thinking_token_budget=64), 400,
     "thinking_token_budget", "not supported"),
    ("logprob-token-ids", "POST", CMPL, _cmpl(logprob_token_ids=[5, 6]), 400,
     "logprob_token_ids", "not supported"),
    ("repetition-detection", "POST", CMPL, _cmpl(repetition_detection={"max_pattern_size": 8}),
     400, "repetition_detection", "not supported"),
    ("kv-transfer-params", "POST", CHAT, _chat(kv_transfer_params={"do_remote_decode": True}),
     400, "kv_transfer_params", "not supported"),
    ("watermarking", "POST", CMPL, _cmpl(watermarking=True), 400, "watermarking",
     "not supported"),
    ("chat-echo", "POST", CHAT, _chat(echo=True), 400, "echo", "not supported"),
    ("prompt-embeds", "POST", CMPL, _cmpl(prompt_embeds="AAAA"), 400, "prompt_embeds",
     "not supported"),
    # beam search with a field that would change the logprobs it ranks
    ("beam-search-top-p", "POST", CMPL, _cmpl(use_beam_search=True, top_p=0.5), 400, "top_p",
     "not supported with use_beam_search"),
    # a priority needs the priority policy (this server serves first come, first served)
    ("priority-under-fcfs", "POST", CHAT, _chat(priority=3), 400, "priority",
     "--scheduling-policy priority"),
    ("priority-not-an-integer", "POST", CMPL, _cmpl(priority="high"), 400, "priority", ""),
    ("priority-past-64-bits", "POST", CMPL, _cmpl(priority=2**64), 400, "priority", ""),
    ("truncate-zero", "POST", CMPL, _cmpl(truncate_prompt_tokens=0), 400,
     "truncate_prompt_tokens", ""),
    ("truncate-past-context", "POST", CHAT, _chat(truncate_prompt_tokens=513), 400,
     "truncate_prompt_tokens", "512"),
    ("truncate-below-minus-one", "POST", CMPL, _cmpl(truncate_prompt_tokens=-2), 400,
     "truncate_prompt_tokens", ""),
    # special tokens on top of the chat template's: not supported, so not dropped either
    ("chat-special-tokens", "POST", CHAT, _chat(add_special_tokens=True), 400,
     "add_special_tokens", "chat template's special tokens"),
    ("tokenize-chat-special-tokens", "POST", "/tokenize",
     {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": True}, 400,
     "add_special_tokens", "chat template's special tokens"),
    # client input stays data: no overriding what the server sets, no templates of its own
    ("template-kwargs-add-generation-prompt", "POST", CHAT,
     _chat(chat_template_kwargs={"add_generation_prompt": False}), 400, "chat_template_kwargs",
     "add_generation_prompt"),
    ("template-kwargs-conversation", "POST", CHAT, _chat(chat_template_kwargs={"conversation": []}),
     400, "chat_template_kwargs", "conversation"),
    ("template-kwargs-messages", "POST", CHAT, _chat(chat_template_kwargs={"messages": []}), 400,
     "chat_template_kwargs", "messages"),
    ("template-kwargs-chat-template", "POST", CHAT,
     _chat(chat_template_kwargs={"chat_template": "{{ 1/0 }}"}), 400, "chat_template_kwargs", ""),
    ("template-kwargs-eos-token", "POST", CHAT, _chat(chat_template_kwargs={"eos_token": "x"}),
     400, "chat_template_kwargs", ""),
    ("chat-template-untrusted", "POST", CHAT, _chat(chat_template="{{ 1/0 }}"), 400,
     "chat_template", "--trust-request-chat-template"),
    # absurd nesting, wherever it hides
    ("nested-template-kwargs", "POST", CHAT, b'{"messages": [{"role": "user", "content": "x"}], '
     b'"chat_template_kwargs": {"a": ' + b"[" * 1000 + b"]" * 1000 + b"}}", 400, None, "nested"),
    ("nested-prompt", "POST", CMPL, b'{"prompt": ' + DEEP + b"}", 400, None, "nested"),
    ("nested-unknown-field", "POST", CMPL, b'{"prompt": "x", "whatever": ' + DEEP + b"}", 400,
     None, "nested"),
    ("nested-tokenize", "POST", "/tokenize", DEEP, 400, None, "nested"),
    # text that cannot fit is refused before the tokenizer spends seconds on it
    ("prompt-megabytes", "POST", CMPL, _cmpl(prompt="word " * 600_000), 400, None,
     "characters cannot fit"),
    ("chat-megabytes", "POST", CHAT, _chat(messages=[{"role": "user", "content": "a b" * 10**6}]),
     400, None, "characters cannot fit"),
]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server, timeout=30) as c:
        yield c


def _error(response: httpx.Response, status: int) -> dict:
    """The error object of an answer, after checking its status and OpenAI's shape."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["code"] == status
    return error


@pytest.mark.parametrize("name,method,path,body,status,param,fragment", CASES,
                         ids=[c[0] for c in CASES])
def test_bad_input(http, name, method, path, body, status, param, fragment):
    content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    response = http.request(method, path, content=content,
                            headers={"Content-Type": "application/json"})
    error = _error(response, status)
    if param is not None:
        assert error["param"] == param, error
    assert fragment.lower() in error["message"].lower(), error


def test_still_serving_after_bad_input(http):
    for name, method, path, body, *_ in CASES:  # every bad request once more, in a burst
        content = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        http.request(method, path, content=content)
    ok = http.post(CHAT, json=_chat(max_tokens=3, temperature=0))
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1
    assert http.get("/health").status_code == 200


def _int_fields(x: int) -> list[tuple[str, str, dict]]:
    """(path, field the error must name, body) for every integer a request can carry, set to x."""
    shared = [("n", {"n": x}), ("seed", {"seed": x}), ("top_k", {"top_k": x}),
              ("min_tokens", {"min_tokens": x}), ("max_tokens", {"max_tokens": x}),
              ("prompt_logprobs", {"prompt_logprobs": x}),
              ("stop_token_ids", {"stop_token_ids": [x]}),
              ("allowed_token_ids", {"allowed_token_ids": [x]}),
              ("logit_bias", {"logit_bias": {str(x): 1}})]
    cmpl = shared + [("logprobs", {"logprobs": x}), ("best_of", {"best_of": x}),
                     ("prompt", {"prompt": [x]}), ("prompt", {"prompt": [[x]]})]
    chat = shared + [("max_completion_tokens", {"max_completion_tokens": x}),
                     ("top_logprobs", {"logprobs": True, "top_logprobs": x})]
    return ([(CMPL, field, _cmpl(**fields)) for field, fields in cmpl]
            + [(CHAT, field, _chat(**fields)) for field, fields in chat])


# past 64 bits either way: msgspec decodes any size of int, msgpack (the trace, the workers)
# encodes at most 64 bits, so one such integer reaching the engine used to stop it
@pytest.mark.parametrize("x", [2**64 + 1, 10**29, -2**70], ids=["2**64+1", "10**29", "-2**70"])
def test_integers_past_64_bits_are_rejected(http, x):
    wrong = []
    for path, field, body in _int_fields(x):
        # raw bytes: json.dumps writes big ints exactly, as a client's JSON library may
        response = http.post(path, content=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
        try:
            error = _error(response, 400)
            assert error["param"] == field, error
        except AssertionError as exc:
            wrong.append(f"{path} {field}: {exc}")
    ok = http.post(CMPL, json=_cmpl(max_tokens=3, temperature=0, ignore_eos=True))
    health = http.get("/health").status_code
    assert not wrong, "\n".join(wrong)
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["text"]
    assert health == 200
