"""Tools through the server with the official ``openai`` client: ``required`` and a named
function (the output held to a schema, so even the tiny random model calls correctly), streamed
and not; ``auto`` read by the Hermes parser; a tool conversation through a chat template that
renders tools, calls and results."""

from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import openai
import pytest
from api_helpers import SERVED_NAME, serving
from transformers import AutoTokenizer

WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}

# a template in the manner of Qwen2.5's: tools in a system turn (their names only: the tiny
# tokenizer spends a token on every few characters, and the context is 512), calls as <tool_call> blocks
# with the arguments as a mapping, results as <tool_response> blocks
TOOLS_TEMPLATE = """\
{%- if tools %}<|im_start|>system
# Tools
{%- for tool in tools %}{{ "\n- " + tool.function.name }}{% endfor %}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response id="{{ message.tool_call_id }}">
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def _create(client, **kw):
    kw.setdefault("max_tokens", 200)
    kw.setdefault("temperature", 1.0)
    return client.chat.completions.create(model=SERVED_NAME, messages=kw.pop("messages", MESSAGES),
                                          tools=TOOLS, **kw)


def _streamed(client, **kw) -> tuple[str, list[tuple[str, str]], list, list]:
    """(content, [(name, arguments)], finish reasons, tool-call deltas) of a streamed answer."""
    content, calls, finishes, deltas = "", {}, [], []
    for chunk in _create(client, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finishes.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or ():
                deltas.append(delta)
                if delta.index not in calls:
                    assert delta.id.startswith("chatcmpl-tool-") and delta.type == "function"
                    calls[delta.index] = [delta.function.name, ""]
                else:
                    assert delta.id is None and delta.function.name is None
                calls[delta.index][1] += delta.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)], finishes, deltas


def _check_calls(message) -> list[tuple[str, str]]:
    assert message.content is None and message.tool_calls
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)
    for call in message.tool_calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


def _check_streamed_equals_whole(client, **kw) -> list[tuple[str, str]]:
    choice = _create(client, **kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = _check_calls(choice.message)
    content, streamed, finishes, deltas = _streamed(client, **kw)
    assert (content, streamed) == ("", calls)
    assert finishes[-1] == "tool_calls" and not any(finishes[:-1])
    assert len(deltas) > 2 * len(calls)  # arguments arrive in pieces
    return calls


def test_required_calls_validate_streamed_and_not(client):
    assert len(_check_streamed_equals_whole(client, tool_choice="required", seed=0,
                                            parallel_tool_calls=False)) == 1
    # parallel calls: the random model ends the array by chance (this seed after three calls)
    choice = _create(client, tool_choice="required", seed=4, max_tokens=300).choices[0]
    assert choice.finish_reason == "tool_calls" and len(_check_calls(choice.message)) > 1


def test_named_function_call_validates_streamed_and_not(client):
    for seed in range(2):
        calls = _check_streamed_equals_whole(client, tool_choice=NAMED, seed=seed)
        assert [name for name, _ in calls] == ["get_weather"]


def test_tool_choice_none_is_plain_text(client):
    choice = _create(client, tool_choice="none", max_tokens=8, temperature=0.0).choices[0]
    assert choice.message.tool_calls in (None, []) and choice.message.content
    assert choice.finish_reason == "length"


def test_auto_needs_the_operators_parser(client):
    with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice"):
        _create(client, max_tokens=4)


@pytest.fixture(scope="module")
def tools_model_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with a chat template that renders tools."""
    path = tmp_path_factory.mktemp("tools") / "model"
    shutil.copytree(tiny_llama_dir, path)
    (path / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def hermes_server(tools_model_dir, tmp_path_factory) -> str:
    """A server that reads Hermes calls for tool_choice auto, on the tools template."""
    log_path = tmp_path_factory.mktemp("hermes") / "server.log"
    with serving(tools_model_dir, log_path, "--num-kv-blocks", "256", "--served-model-name",
                 SERVED_NAME, "--enable-auto-tool-choice", "--tool-call-parser", "hermes") \
            as (proc, base):
        yield base
        proc.terminate()
        proc.wait(timeout=20)


@pytest.fixture(scope="module")
def hermes_client(hermes_server):
    with openai.OpenAI(base_url=hermes_server + "/v1", api_key="unused", max_retries=0,
                       timeout=60) as c:
        yield c


# the tiny model writes a Hermes call only when a grammar makes it: text first, then the call
HERMES_ANSWER = (r'Sure\. <tool_call>\{"name": "get_time", "arguments": \{"tz": "(utc|cet)"\}\}'
                 r'</tool_call>')


def test_auto_reads_hermes_calls_streamed_and_not(hermes_client):
    kw = dict(seed=1, max_tokens=200, extra_body={"guided_regex": HERMES_ANSWER})
    choice = _create(hermes_client, **kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure. "
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["tz"] in ("utc", "cet")
    content, calls, finishes, _ = _streamed(hermes_client, **kw)
    assert (content, calls) == ("Sure. ", [("get_time", call.function.arguments)])
    assert finishes[-1] == "tool_calls"
    # no call in the text: all of it is content
    plain = _create(hermes_client, max_tokens=8, temperature=0.0).choices[0]
    assert plain.message.tool_calls in (None, []) and plain.message.content
    assert plain.finish_reason == "length"


def test_a_tool_conversation_round_trips_through_the_template(hermes_server, hermes_client,
                                                              tools_model_dir):
    first = _create(hermes_client, tool_choice=NAMED, seed=3).choices[0].message
    [call] = first.tool_calls
    conversation = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = _create(hermes_client, messages=conversation, tool_choice="none", max_tokens=4)
    assert second.choices[0].message.content
    tokenizer = AutoTokenizer.from_pretrained(tools_model_dir)
    rendered = httpx.post(hermes_server + "/tokenize",
                          json={"messages": conversation, "tools": TOOLS}).json()
    assert rendered["count"] == second.usage.prompt_tokens
    arguments = json.dumps(json.loads(call.function.arguments))  # a mapping, not a string
    tools = "".join("\n- " + t["function"]["name"] for t in TOOLS)
    assert tokenizer.decode(rendered["tokens"]) == (
        f"<|im_start|>system\n# Tools{tools}<|im_end|>\n"
        f"<|im_start|>user\n{MESSAGES[0]['content']}<|im_end|>\n"
        f"<|im_start|>assistant\n<tool_call>\n"
        f'{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call><|im_end|>\n'
        f'<|im_start|>user\n<tool_response id="{call.id}">\nsunny, 21 C\n</tool_response>'
        f"<|im_end|>\n<|im_start|>assistant\n")
