"""OpenAI's Responses API through the official ``openai`` client: a response is the chat
answer to the same conversation (its instructions a system message first), whole or as the
Responses events; stored answers continue by ``previous_response_id`` and are retrieved and
deleted by id; function tools, a JSON schema for the text, logprobs; what is not implemented
is refused by name."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from api_helpers import SERVED_NAME

QUESTION = "Tell me about the village and the baker."
INSTRUCTIONS = "Answer in one sentence."
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
GREEDY = dict(temperature=0.0, max_output_tokens=12)


def _respond(client, **kw):
    kw = {**GREEDY, "input": QUESTION, **kw}
    return client.responses.create(model=SERVED_NAME, **kw)


def _chat(client, messages, max_tokens=12):
    return client.chat.completions.create(model=SERVED_NAME, messages=messages, temperature=0.0,
                                          max_tokens=max_tokens)


def test_a_response_is_the_chat_answer_to_its_conversation(client):
    response = _respond(client, instructions=INSTRUCTIONS)
    chat = _chat(client, [{"role": "system", "content": INSTRUCTIONS},
                          {"role": "user", "content": QUESTION}])
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.model == SERVED_NAME and response.instructions == INSTRUCTIONS
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == 12
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    # cut at max_output_tokens: incomplete, and said why
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "completed"


def test_a_streamed_response_sends_the_responses_events(client):
    whole = _respond(client)
    events = list(_respond(client, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and kinds[4:4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(d.delta for d in deltas)
    assert text == whole.output_text == events[-4].text
    last = events[-1].response
    assert last.output_text == text and last.status == "incomplete"
    assert last.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(last.id).output_text == text


def test_a_stored_response_continues_its_conversation_and_can_be_deleted(client):
    first = _respond(client, instructions=INSTRUCTIONS)
    second = _respond(client, input="And the river?", previous_response_id=first.id)
    chat = _chat(client, [{"role": "user", "content": QUESTION},  # (instructions not kept)
                          {"role": "assistant", "content": first.output_text},
                          {"role": "user", "content": "And the river?"}])
    assert second.previous_response_id == first.id
    assert second.output_text == chat.choices[0].message.content
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match=first.id):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as refused:
        _respond(client, previous_response_id=first.id)
    assert refused.value.body["param"] == "previous_response_id"
    unstored = _respond(client, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_a_stored_responses_input_items_come_back_a_page_at_a_time(client, server):
    """OpenAI's ``input_items``: the request's items with ids (a text is one user message of
    input_text), newest first unless ``order`` asc, ``limit`` at a time ``after`` an id."""
    texts = ["One.", "Two.", "Three."]
    response = _respond(client, input=[{"role": "user", "content": t} for t in texts])
    newest = client.responses.input_items.list(response.id)
    assert [item.content[0].text for item in newest.data] == texts[::-1]
    assert all(item.type == "message" and item.role == "user" and item.id.startswith("msg_")
               and item.content[0].type == "input_text" for item in newest.data)
    first = client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [item.content[0].text for item in first.data] == texts[:2] and first.has_more
    rest = client.responses.input_items.list(response.id, order="asc", after=first.data[-1].id)
    assert [item.content[0].text for item in rest.data] == texts[2:] and not rest.has_more
    text = _respond(client)
    [only] = client.responses.input_items.list(text.id).data
    assert (only.role, only.content[0].text) == ("user", QUESTION)
    for query, param in (("limit=0", "limit"), ("order=sideways", "order"),
                         ("after=msg_nope", "after")):
        answer = httpx.get(f"{server}/v1/responses/{text.id}/input_items?{query}", timeout=30)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_unknown")


def test_a_named_function_is_called_and_its_output_answered(client):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather",
              "parameters": WEATHER}]
    called = _respond(client, tools=tools, tool_choice={"type": "function", "name": "get_weather"},
                      temperature=1.0, max_output_tokens=200)
    assert called.status == "completed"
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    # the next turn: the call's output, on top of the stored conversation
    answered = _respond(client, previous_response_id=called.id, tools=tools, tool_choice="none",
                        input=[{"type": "function_call_output", "call_id": call.call_id,
                                "output": '{"sky": "clear"}'}])
    assert answered.output_text
    # seeded: unseeded, a third of the draws keep adding calls past the token limit
    streamed = list(_respond(client, tools=tools, tool_choice="required", temperature=1.0,
                             max_output_tokens=300, stream=True, extra_body={"seed": 2}))
    done = [e.item for e in streamed if e.type == "response.output_item.done"]
    assert done and all(item.type == "function_call" for item in done)
    for item in done:  # (parallel calls: one item each)
        arguments = "".join(e.delta for e in streamed
                            if e.type == "response.function_call_arguments.delta" and
                            e.item_id == item.id)
        assert item.arguments == arguments and json.loads(arguments)
    assert streamed[-1].type == "response.completed"
    assert [item.id for item in streamed[-1].response.output] == [item.id for item in done]


def test_the_text_follows_a_json_schema(client):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 8}},
              "required": ["answer"], "additionalProperties": False}
    # seeded: one unseeded draw at temperature 1 wrote bytes that xgrammar's maxLength counted
    # as one character and that decoded to three replacement characters (11 > 8)
    response = _respond(client, temperature=1.0, max_output_tokens=100, text={
        "format": {"type": "json_schema", "name": "short", "schema": schema}},
        extra_body={"seed": 0})
    assert response.text.format.type == "json_schema"
    jsonschema.validate(json.loads(response.output_text), schema)


def test_a_reasoning_setting_left_unset_is_no_setting(client):
    response = _respond(client, reasoning={"effort": None, "summary": None})
    assert response.output_text and response.error is None


def test_logprobs_come_with_each_output_token(client):
    response = _respond(client, top_logprobs=2, include=["message.output_text.logprobs"])
    logprobs = response.output[0].content[0].logprobs
    assert len(logprobs) == response.usage.output_tokens
    assert "".join(lp.token for lp in logprobs) == response.output_text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)


@pytest.mark.parametrize("fields, param, said", [
    ({"truncation": "auto"}, "truncation", "truncation: not supported"),
    ({"include": ["reasoning.encrypted_content"]}, "include[0]", "reasoning.encrypted_content"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'web_search' is not supported"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type", "'file_search'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", "only text parts"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "'item_reference'"),
    ({"input": [{"type": "function_call", "call_id": "c"}]}, "input[0]", "name"),
    ({"max_output_tokens": 10**6}, "max_output_tokens", "maximum context length is 512"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary", "reasoning.summary: not supported"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort", "one of none, minimal, low"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format",
     "text.format: json_schema.schema is required"),
])
def test_what_is_not_implemented_or_wrong_is_a_400_naming_it(server, client, fields, param,
                                                             said):
    body = {"model": SERVED_NAME, "input": QUESTION, **fields}
    answer = httpx.post(server + "/v1/responses", json=body, timeout=60)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    assert said in answer.json()["error"]["message"]
    assert _respond(client).output_text  # the server keeps serving
