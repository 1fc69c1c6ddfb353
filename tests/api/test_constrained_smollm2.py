"""The embedded SmolLM2 behind the server, driven by the ``openai`` client: fifty JSON Schema
answers, a regex and a choice, every one of them valid (the tiny-model tests hold the rest)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from api_helpers import serving

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 24},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 24},
                    "maxItems": 3},
    },
    "required": ["name", "age", "pet", "address", "hobbies"],
}


@pytest.mark.slow
def test_smollm2_answers_validate_through_the_server(smollm2_dir, tmp_path):
    import openai

    with serving(smollm2_dir, tmp_path / "server.log") as (_, base):
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0,
                               timeout=300)
        model = client.models.list().data[0].id
        response_format = {"type": "json_schema",
                           "json_schema": {"name": "person", "schema": SCHEMA}}

        def person(i: int):
            messages = [{"role": "user", "content": f"Invent person number {i} as JSON."}]
            return client.chat.completions.create(
                model=model, messages=messages, max_tokens=200, temperature=1.0, seed=i,
                response_format=response_format)

        with ThreadPoolExecutor(50) as pool:
            answers = list(pool.map(person, range(50)))
        for answer in answers:
            jsonschema.validate(json.loads(answer.choices[0].message.content), SCHEMA)
        date = client.chat.completions.create(
            model=model, max_tokens=16, temperature=0.0,
            messages=[{"role": "user", "content": "When did the Bastille fall?"}],
            extra_body={"structured_outputs": {"regex": r"[0-9]{4}-[0-9]{2}-[0-9]{2}"}})
        assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", date.choices[0].message.content)
        yes_no = client.chat.completions.create(
            model=model, max_tokens=4, temperature=0.0,
            messages=[{"role": "user", "content": "Is Paris in France?"}],
            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
        assert yes_no.choices[0].message.content in ("yes", "no")
