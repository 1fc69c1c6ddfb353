"""Constrained output through the server with the official ``openai`` client: a JSON Schema
(``response_format``, a pydantic model through ``beta...parse``), a regex, a choice, a grammar
and a structural tag (vLLM's ``structured_outputs`` and older ``guided_*`` fields, its
``response_format`` of type ``structural_tag``), for chat and completions.

The tiny random model never writes valid JSON by chance, and it ends a string only where the
schema bounds it (``pattern``, ``enum``, ``maxItems``, integer ranges): what validates here
validates because of the grammar.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import pytest
from api_helpers import SERVED_NAME
from pydantic import BaseModel, Field, conint
from schemas import PERSON

from actorlm.api.errors import ApiError
from actorlm.api.serving import _checked
from actorlm.outputs import CompletionOutput, RequestOutput

MESSAGES = [{"role": "user", "content": "Invent a person."}]


def _chat(client, seed: int, **kw):
    return client.chat.completions.create(model=SERVED_NAME, messages=MESSAGES, max_tokens=160,
                                          temperature=1.0, seed=seed, **kw)


def test_fifty_json_schema_answers_all_validate(client):
    response_format = {"type": "json_schema",
                       "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    with ThreadPoolExecutor(50) as pool:  # one batch
        answers = list(pool.map(lambda i: _chat(client, i, response_format=response_format),
                                range(50)))
    texts = []
    for answer in answers:
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        texts.append(choice.message.content)
    assert len(set(texts)) > 40  # sampled, not one canned answer


class Address(BaseModel):
    city: str = Field(pattern=r"^[a-z]{1,8}$", max_length=8)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(pattern=r"^[A-Z][a-z]{1,8}$", max_length=9)
    role: Literal["baker", "miller", "farmer"]
    age: conint(ge=18, le=99)
    address: Address


def test_pydantic_model_through_parse(client):
    for seed in range(2):
        answer = client.beta.chat.completions.parse(
            model=SERVED_NAME, messages=MESSAGES, response_format=Person, max_tokens=120,
            temperature=1.0, seed=seed)
        choice = answer.choices[0]
        assert choice.finish_reason == "stop"
        person = choice.message.parsed
        assert isinstance(person, Person) and 18 <= person.age <= 99
        assert person == Person.model_validate_json(choice.message.content)


@pytest.mark.parametrize("field,value,valid", [
    ("structured_outputs", {"regex": r"[0-9]{3}-[a-z]{2,4}"},
     lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    ("structured_outputs", {"choice": ["left", "right", "up"]},
     lambda t: t in ("left", "right", "up")),
    ("structured_outputs", {"grammar": 'root ::= "(" [a-c] [a-c]? ")"'},
     lambda t: re.fullmatch(r"\([a-c]{1,2}\)", t)),
    ("guided_regex", r"[A-Z][a-z]{2}!", lambda t: re.fullmatch(r"[A-Z][a-z]{2}!", t)),
    ("guided_choice", ["yes", "no"], lambda t: t in ("yes", "no")),
    ("guided_json", {"enum": ["x", "y"]}, lambda t: t in ('"x"', '"y"')),
    ("structured_outputs", {"structural_tag": {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<pet>", "end": "</pet>", "content": {
            "type": "json_schema", "json_schema": {"enum": ["cat", "dog"]}}}}},
     lambda t: t in ('<pet>"cat"</pet>', '<pet>"dog"</pet>')),
    ("response_format", {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<n>", "end": "</n>", "content": {
            "type": "json_schema", "json_schema": {"type": "integer", "minimum": 1,
                                                   "maximum": 9}}}},
     lambda t: re.fullmatch(r"<n>[1-9]</n>", t)),
], ids=["regex", "choice", "grammar", "guided-regex", "guided-choice", "guided-json",
        "structural-tag", "response-format-structural-tag"])
def test_regex_choice_grammar_in_chat_and_completions(client, field, value, valid):
    extra = {"extra_body": {field: value}}
    for seed in range(4):
        chat = _chat(client, seed, **extra).choices[0]
        assert valid(chat.message.content) and chat.finish_reason == "stop", chat
        text = client.completions.create(model=SERVED_NAME, prompt="Answer:", max_tokens=40,
                                         temperature=1.0, seed=seed, **extra).choices[0].text
        assert valid(text), text
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       _chat(client, 0, stream=True, **extra) if c.choices)
    assert streamed == _chat(client, 0, **extra).choices[0].message.content


def test_json_schema_in_completions_streamed(client):
    schema = {"type": "object", "properties": {"pet": PERSON["properties"]["pet"],
                                               "age": PERSON["properties"]["age"]},
              "required": ["pet", "age"], "additionalProperties": False}
    kw = dict(model=SERVED_NAME, prompt="Pet:", max_tokens=40, temperature=1.0, seed=5,
              extra_body={"response_format": {"type": "json_schema",
                                              "json_schema": {"name": "p", "schema": schema}}})
    whole = client.completions.create(**kw).choices[0]
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw)
                       if c.choices)
    assert whole.finish_reason == "stop" and streamed == whole.text
    jsonschema.validate(json.loads(whole.text), schema)


def test_a_grammar_the_engine_refuses_is_the_clients_error():
    """A constraint that gets past the checks at the edge and fails to compile in the engine
    comes back as the request's error: a 400, not a server fault."""
    failed = RequestOutput("r", None, [1], [CompletionOutput(0, "", [], finish_reason="error")],
                           finished=True, error="structured_outputs: Rule 'x' is not defined",
                           error_field="structured_outputs")
    with pytest.raises(ApiError) as refused:
        _checked(failed)
    assert refused.value.status == 400 and "Rule 'x'" in refused.value.message
    assert refused.value.param == "structured_outputs"
    # the engine's own fault stays a 500, whatever its text begins with
    for text in ("the worker died", "structured_outputs: the grammar thread died"):
        broken = RequestOutput("r", None, [1],
                               [CompletionOutput(0, "", [], finish_reason="error")],
                               finished=True, error=text)
        with pytest.raises(ApiError) as fault:
            _checked(broken)
        assert fault.value.status == 500
