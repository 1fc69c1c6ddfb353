"""``--reasoning-parser`` through the server with the official ``openai`` client, on a tiny
checkpoint whose tokenizer has ``<think>`` and ``</think>`` and whose chat template opens the
think (``enable_thinking=False`` closes an empty one instead, as Qwen3's does).

What this proves, and what not: the random model writes no think tags of its own, so each test
first asks ``/v1/completions`` for the raw text of the very prompt the chat template renders
(greedy, the same engine: the same tokens), and then checks that the chat answer — whole and
streamed — is the parser's split of that text. A ``logit_bias`` on ``</think>`` makes the
model end its think after a few tokens; the bias is found by trying a few, since where the end
lands depends on the random weights. The splitting rules themselves (tags cut across chunks,
unterminated thinks, qwen3 without a think) are ``test_reasoning_parsers``'s. The grammar test
proves the grammar waited for the think: under a grammar from the first token the model could
never have written ``</think>`` (no choice contains it), and its reply would sit unterminated
in the think.
"""

from __future__ import annotations

import json
import types

import openai
import pytest
from api_helpers import SERVED_NAME, running

from actorlm.api import protocol as p
from actorlm.api.cli import main
from actorlm.api.options import ServerOptions
from actorlm.api.server import create_app
from actorlm.api.serving import _Generation
from actorlm.api.tool_choice import ToolUse
from actorlm.api.tool_parsers import PARSERS
from actorlm.async_llm import AsyncLLM
from actorlm.outputs import CompletionOutput, RequestOutput
from actorlm.reasoning import REASONING_PARSERS, ThinkTokens, split_reasoning

MESSAGES = [{"role": "user", "content": "Once upon a time"}]
CHOICES = ["yes", "no"]
THINK_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
# the tiny model writes a Hermes call only when a grammar makes it
HERMES_ANSWER = (r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"tz": "utc"\}\}'
                 r'</tool_call>')
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def thinking_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny Llama whose vocabulary has the think tags (plain added tokens, as Qwen3's and
    DeepSeek-R1's: the detokenized text keeps them) and whose template opens a think."""
    from checkpoints import _common, _save_tiny
    from transformers import AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = THINK_TEMPLATE
    tokenizer_dir = tmp_path_factory.mktemp("think_tokenizer")
    tokenizer.save_pretrained(tokenizer_dir)
    config = LlamaConfig(**_common(tokenizer_dir), tie_word_embeddings=True, rope_theta=10000.0)
    return _save_tiny(tmp_path_factory, tokenizer_dir, "tiny_thinking", config, seed=3)


@pytest.fixture(scope="module")
def think_server(thinking_dir):
    """(client, engine): the app in this process with the qwen3 parser and Hermes tool calls."""
    engine = AsyncLLM(str(thinking_dir), dtype="float32", num_kv_blocks=256,
                      reasoning_parser="qwen3")
    options = ServerOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")
    try:
        with running(create_app(engine, served_model_name=SERVED_NAME, options=options)) \
                as base, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                                       timeout=60) as client:
            yield client, engine
    finally:
        engine.shutdown()


def _prompt(engine, **template_kwargs) -> list[int]:
    return engine.apply_chat_template(MESSAGES, True, **template_kwargs)


def _raw(client, prompt_ids, bias=None, max_tokens=16) -> str:
    """The model's plain text for the prompt (no parser reads completions)."""
    extra = {"logit_bias": bias} if bias else {}
    return client.completions.create(model=SERVED_NAME, prompt=prompt_ids, max_tokens=max_tokens,
                                     temperature=0.0, **extra).choices[0].text


def _chat(client, stream=False, template_kwargs=None, bias=None, max_tokens=16, **extra):
    if template_kwargs:
        extra["chat_template_kwargs"] = template_kwargs
    return client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, max_tokens=max_tokens, temperature=0.0,
        stream=stream, logit_bias=bias, extra_body=extra or None)


def _whole(client, **kw) -> tuple[str | None, str | None, str]:
    message = (choice := _chat(client, **kw).choices[0]).message
    extra = message.model_extra
    assert extra["reasoning"] == extra["reasoning_content"]  # vLLM's two names, one text
    return extra["reasoning_content"], message.content, choice.finish_reason


def _streamed(client, **kw) -> tuple[str | None, str | None, str]:
    reasoning, content, finish = [], [], None
    for chunk in _chat(client, stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            assert delta.get("reasoning") == delta.get("reasoning_content")
            if delta.get("reasoning_content"):
                reasoning.append(delta["reasoning_content"])
            if delta.get("content"):
                content.append(delta["content"])
            finish = choice.finish_reason or finish
    return ("".join(reasoning) or None), ("".join(content) or None), finish


def _expected(engine, prompt_ids, text) -> tuple[str | None, str | None]:
    reasoning, content = split_reasoning(engine.reasoning.text_stream(prompt_ids), text)
    return reasoning, content or None


@pytest.fixture(scope="module")
def end_bias(think_server):
    """A logit bias on </think> under which the greedy think ends after a few tokens."""
    client, engine = think_server
    end_id = engine.reasoning.end_token_id
    for bias in range(1, 13):
        text = _raw(client, _prompt(engine), {str(end_id): bias})
        if "</think>" in text and not text.startswith("</think>"):
            return {str(end_id): bias}, text
    pytest.fail("no bias ends the think after a few tokens: change the checkpoint's seed")


def test_a_think_the_template_opened_is_reasoning_until_it_ends(think_server):
    client, engine = think_server
    ids = _prompt(engine)
    raw = _raw(client, ids)
    assert "</think>" not in raw  # the random model never ends its think unaided
    assert _whole(client) == (raw, None, "length")  # unterminated: all reasoning
    assert _streamed(client) == (raw, None, "length")


def test_the_end_of_the_think_splits_reasoning_from_content(think_server, end_bias):
    client, engine = think_server
    bias, raw = end_bias
    reasoning, content = _expected(engine, _prompt(engine), raw)
    assert reasoning and reasoning == raw.split("</think>")[0] and content
    assert _whole(client, bias=bias)[:2] == (reasoning, content)
    assert _streamed(client, bias=bias)[:2] == (reasoning, content)


def test_include_reasoning_false_leaves_the_think_out(think_server, end_bias):
    # vLLM's include_reasoning: the think is still split off, and not sent
    client, engine = think_server
    bias, raw = end_bias
    _, content = _expected(engine, _prompt(engine), raw)
    for answer in (_whole, _streamed):
        assert answer(client, bias=bias, include_reasoning=False)[:2] == (None, content)


def test_a_stream_without_its_think_sends_no_token_ids(think_server, end_bias):
    # (vLLM's rule: the ids would give the think away)
    client, _ = think_server
    extra = {"include_reasoning": False, "return_token_ids": True}
    chunks = list(_chat(client, stream=True, bias=end_bias[0], **extra))
    assert not any("token_ids" in c.choices[0].model_extra for c in chunks if c.choices)
    kept = list(_chat(client, stream=True, bias=end_bias[0], return_token_ids=True))
    assert any("token_ids" in c.choices[0].model_extra for c in kept if c.choices)


def test_a_grammar_constrains_only_what_follows_the_think(think_server, end_bias):
    client, engine = think_server
    bias, raw = end_bias
    reasoning = raw.split("</think>")[0]
    for answer in (_whole, _streamed):
        think, content, finish = answer(client, bias=bias, max_tokens=40,
                                        structured_outputs={"choice": CHOICES})
        assert think == reasoning and content in CHOICES and finish == "stop"


def test_a_think_closed_in_the_prompt_leaves_all_content(think_server):
    client, engine = think_server
    off = {"enable_thinking": False}
    raw = _raw(client, _prompt(engine, **off))
    assert _whole(client, template_kwargs=off) == (None, raw, "length")
    assert _streamed(client, template_kwargs=off) == (None, raw, "length")
    # the grammar applies from the first token: there is no think to wait for
    think, content, finish = _whole(client, template_kwargs=off,
                                    structured_outputs={"choice": CHOICES})
    assert (think, finish) == (None, "stop") and content in CHOICES


def test_tool_calls_are_read_from_the_content_after_the_think(think_server):
    client, engine = think_server
    bias = {str(engine.reasoning.end_token_id): 100}  # the think ends at once
    answer = client.chat.completions.create(
        model=SERVED_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200, temperature=0.0,
        logit_bias=bias, extra_body={"structured_outputs": {"regex": HERMES_ANSWER}})
    choice = answer.choices[0]
    assert choice.message.model_extra["reasoning_content"] == ""
    assert choice.message.content == "Sure. " and choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {"tz": "utc"})


def test_a_response_holds_the_think_as_its_reasoning_item(think_server):
    """The Responses API: the think is a reasoning item before the answer, whole and
    streamed, and the usage counts its tokens."""
    client, engine = think_server
    raw = _raw(client, _prompt(engine))
    kw = dict(model=SERVED_NAME, input=MESSAGES[0]["content"], max_output_tokens=16,
              temperature=0.0)
    response = client.responses.create(**kw)
    [reasoning] = response.output  # (unterminated: no answer after it)
    assert reasoning.type == "reasoning" and reasoning.content[0].text == raw
    assert response.usage.output_tokens_details.reasoning_tokens == 16
    events = list(client.responses.create(**kw, stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == raw
    assert events[-1].response.output[0].content[0].text == raw
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == 16
    closed = client.responses.create(**{**kw, "input": [
        {"role": "user", "content": MESSAGES[0]["content"]}]}, extra_body={"top_k": 1})
    assert closed.output[0].content[0].text == raw  # (vLLM's top_k, and the same answer)


# --- the chat answer's order of parsing, without an engine ---------------------------------------

THINK_START, THINK_END = 400, 401
CALL = '<tool_call>{"name": "get_time", "arguments": {"tz": "utc"}}</tool_call>'
TEXT = f"I could say {CALL} here.</think>Sure. {CALL}"


async def _outputs(pieces):
    text = ""
    for i, piece in enumerate(pieces):
        text += piece
        done = i == len(pieces) - 1
        yield RequestOutput("r", None, [1, THINK_START], [CompletionOutput(
            0, text, list(range(i + 1)), finish_reason="stop" if done else None)], done)


def _generation(stream: bool) -> _Generation:
    request = types.SimpleNamespace(state=types.SimpleNamespace(request_id="r",
                                                                request_id_from_client=False))
    req = p.ChatCompletionRequest(messages=[p.ChatMessage("user", "hi")], stream=stream)
    tools = ToolUse("auto", parser=PARSERS["hermes"]())
    think = ThinkTokens(REASONING_PARSERS["qwen3"], THINK_START, THINK_END)
    gen = _Generation(types.SimpleNamespace(decode=None), "m", "chatcmpl", request, req,
                      ServerOptions(), tools, think)
    gen.prompt_token_ids = [[1, THINK_START]]  # the template opened the think
    return gen


@pytest.mark.parametrize("cut", [1, 3, 7])
def test_tool_parsing_sees_only_the_content(cut):
    """A call written inside the think stays reasoning text; the one after it is a call."""
    import asyncio

    final = RequestOutput("r", None, [1, THINK_START],
                          [CompletionOutput(0, TEXT, [0], finish_reason="stop")], True)
    message = _generation(False).chat_response([final]).choices[0].message
    assert message.reasoning_content == message.reasoning == f"I could say {CALL} here."
    assert message.content == "Sure. " and [c.function.name for c in message.tool_calls] == \
        ["get_time"]

    gen = _generation(True)
    gen.streams = [_outputs([TEXT[i:i + cut] for i in range(0, len(TEXT), cut)])]

    async def events():
        return [e async for e in gen.chat_events()]

    chunks = [json.loads(e[len(b"data: "):]) for e in asyncio.run(events())[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message.reasoning_content
    assert "".join(d.get("content") or "" for d in deltas) == "Sure. "
    [call] = [t for d in deltas for t in d.get("tool_calls", [])]
    assert call["function"]["name"] == "get_time"
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


# --- tags that are special tokens, and a history with an earlier think ---------------------------

SEED_TEMPLATE = (
    "{% for message in messages %}<seed:bos>{{ message['role'] }}\n{{ message['content'] }}"
    "<seed:eos>{% endfor %}{% if add_generation_prompt %}<seed:bos>assistant\n{% endif %}")
SEED_TAGS = ["<seed:bos>", "<seed:eos>", "<seed:think>", "</seed:think>"]


@pytest.fixture(scope="module")
def seed_server(tmp_path_factory, tiny_tokenizer_dir):
    """(client, engine) with the seed_oss parser over a tiny Llama whose think tags and turn
    token are special tokens, as Seed-OSS's are: a decode that skips special tokens drops them."""
    from checkpoints import _common, _save_tiny
    from transformers import AutoTokenizer, LlamaConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": SEED_TAGS})
    tokenizer.chat_template = SEED_TEMPLATE
    tokenizer_dir = tmp_path_factory.mktemp("seed_tokenizer")
    tokenizer.save_pretrained(tokenizer_dir)
    config = LlamaConfig(**_common(tokenizer_dir), tie_word_embeddings=True, rope_theta=10000.0)
    model_dir = _save_tiny(tmp_path_factory, tokenizer_dir, "tiny_seed", config, seed=5)
    engine = AsyncLLM(str(model_dir), dtype="float32", num_kv_blocks=256,
                      reasoning_parser="seed_oss")
    try:
        with running(create_app(engine, served_model_name=SERVED_NAME)) as base, \
                openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                              timeout=60) as client:
            yield client, engine
    finally:
        engine.shutdown()


def test_special_token_tags_stay_in_the_text_the_parser_splits(seed_server):
    client, engine = seed_server
    assert engine.reasoning.tags_are_special
    ids, end_id = _prompt(engine), engine.reasoning.end_token_id
    for bias in range(1, 13):
        raw = client.completions.create(
            model=SERVED_NAME, prompt=ids, max_tokens=16, temperature=0.0,
            logit_bias={str(end_id): bias}, extra_body={"skip_special_tokens": False}
        ).choices[0].text
        if "</seed:think>" in raw and not raw.startswith("</seed:think>"):
            break
    else:
        pytest.fail("no bias ends the think after a few tokens: change the checkpoint's seed")
    skipped = _raw(client, ids, {str(end_id): bias})
    assert "</seed:think>" not in skipped  # what a decode skipping special tokens would split
    reasoning, content = raw.split("</seed:think>", 1)
    assert reasoning and content
    assert _whole(client, bias={str(end_id): bias})[:2] == (reasoning, content)
    assert _streamed(client, bias={str(end_id): bias})[:2] == (reasoning, content)


def test_an_earlier_answers_think_does_not_end_this_one(seed_server):
    """The history's closed think comes before this turn's <seed:bos>: the answer still starts
    inside its think (Seed-OSS reasons first), so an unterminated one is all reasoning."""
    client, engine = seed_server
    history = [*MESSAGES, {"role": "assistant",
                           "content": "<seed:think>old</seed:think>Old answer."},
               {"role": "user", "content": "And then?"}]
    ids = engine.apply_chat_template(history, True)
    assert engine.reasoning.end_token_id in ids
    raw = client.completions.create(model=SERVED_NAME, prompt=ids, max_tokens=16,
                                    temperature=0.0, extra_body={"skip_special_tokens": False}
                                    ).choices[0].text
    assert "</seed:think>" not in raw
    answer = client.chat.completions.create(model=SERVED_NAME, messages=history, max_tokens=16,
                                            temperature=0.0).choices[0]
    assert answer.message.model_extra["reasoning_content"] == raw
    assert answer.message.content is None and answer.finish_reason == "length"


# --- start-up errors --------------------------------------------------------------------------


def test_an_unknown_parser_is_refused_before_anything_loads(capsys):
    assert main(["serve", "--reasoning-parser", "deepseek"]) == 2
    assert "--reasoning-parser: unknown parser 'deepseek' (known: deepseek_r1, deepseek_v3, " \
        "glm45, mimo, minimax_m2, mistral, openai_gptoss, qwen3, seed_oss, step3)" in \
        capsys.readouterr().err


def test_a_model_without_think_tokens_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="--reasoning-parser deepseek_r1: the tokenizer of .* "
                                         "has no '<think>' token"):
        AsyncLLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64,
                 reasoning_parser="deepseek_r1")
