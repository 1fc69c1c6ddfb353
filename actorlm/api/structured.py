"""The request fields that constrain the output, gathered into one ``StructuredOutputsParams``.

Three spellings reach the same engine feature: OpenAI's ``response_format`` (``json_object``,
``json_schema``, and vLLM's ``structural_tag``), vLLM's ``structured_outputs`` extra body, and
vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``. A request
may use one of them, once: two constraints cannot both hold, so a second one is a 400 rather
than a silent choice.

What can be checked without the model is checked here, before the request reaches the engine:
a JSON Schema must be a valid schema (``jsonschema``) that xgrammar can translate, a regex and
a grammar must parse. The engine's compile (with the tokenizer) can still refuse one; that
arrives as the request's error and is the client's 400 too (``serving``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

import msgspec
from msgspec import Struct

from actorlm.api.errors import ApiError
from actorlm.api.refused import RefusedFields
from actorlm.sampling_params import StructuredOutputsParams

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class JsonSchemaFormat(Struct, kw_only=True, rename={"schema_": "schema"}):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = None
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural_tag: xgrammar's ``format``, or its first ``structures`` and ``triggers``
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    def structural_tag(self) -> dict:
        if self.format is None and self.structures is None:
            raise ApiError(400, "response_format: a structural_tag needs its format (or "
                                "structures and triggers)", "response_format")
        if self.format is not None:
            return {"type": "structural_tag", "format": self.format}
        return {"structures": self.structures, "triggers": self.triggers or []}


class StructuredOutputsField(Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's ``structured_outputs`` extra body: exactly one of the first five."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict[str, Any] | None = None
    # vLLM's knobs that change nothing here: JSON is always compact, extra properties are
    # never generated unless the schema allows them, and xgrammar is the only backend
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    disable_fallback: bool | None = None


class StructuredFields(RefusedFields, kw_only=True):
    """The constraining fields of completions and chat completions (on top of the refused
    ones: a msgspec struct has one line of bases)."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def requested_constraint(self) -> tuple[str, StructuredOutputsParams] | None:
        """(the field it came from, the constraint) the request asks for; a 400 for two."""
        found: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise ApiError(400, "response_format: json_schema.schema is required when type "
                                    "is json_schema", "response_format")
            found.append(("response_format", {"json": rf.json_schema.schema_}))
        elif rf is not None and rf.type == "structural_tag":
            found.append(("response_format", {"structural_tag": rf.structural_tag()}))
        so = self.structured_outputs
        if so is not None:
            kinds = {k: getattr(so, k) for k in ("json", "regex", "choice", "grammar",
                                                 "structural_tag")
                     if getattr(so, k) is not None}
            if so.json_object:
                kinds["json_object"] = True
            found.append(("structured_outputs", kinds))
        for name, kind in GUIDED_FIELDS.items():
            if getattr(self, name):  # vLLM read these by truth: an empty one is off
                found.append((name, {kind: getattr(self, name)}))
        if not found:
            return None
        if len(found) > 1:
            names = " and ".join(name for name, _ in found)
            raise ApiError(400, f"{names}: give one way to constrain the output, not several",
                           found[1][0])
        field, kwargs = found[0]
        try:
            return field, StructuredOutputsParams(**kwargs)
        except ValueError as exc:
            raise ApiError(400, f"{field}: {_without_prefix(str(exc))}", field) from None


async def checked_constraint(request: StructuredFields) -> StructuredOutputsParams | None:
    """The request's constraint, checked as far as it can be without the model (off the event
    loop: a large schema takes a moment to translate)."""
    requested = request.requested_constraint()
    if requested is None:
        return None
    field, params = requested
    await asyncio.to_thread(check_constraint, field, params)
    return params


def check_constraint(field: str, params: StructuredOutputsParams) -> None:
    """A 400 naming ``field`` when the constraint is not a valid schema, regex or grammar."""
    import jsonschema
    import xgrammar

    from actorlm.core.structured_output import json_schema_grammar, structural_tag_grammar

    try:
        if params.json is not None:
            schema = msgspec.json.decode(params.json)
            jsonschema.validators.validator_for(schema).check_schema(schema)
            json_schema_grammar(params.json)
        elif params.regex is not None:
            xgrammar.Grammar.from_regex(params.regex)
        elif params.grammar is not None:
            xgrammar.Grammar.from_ebnf(params.grammar)
        elif params.structural_tag is not None:
            structural_tag_grammar(params.structural_tag)
    except jsonschema.SchemaError as exc:
        raise ApiError(400, f"{field}: not a valid JSON Schema: {exc.message}", field) from None
    except Exception as exc:  # xgrammar's parsers raise RuntimeError with the position
        raise ApiError(400, f"{field}: {_xgrammar_message(exc)}", field) from None


def _without_prefix(message: str) -> str:
    # SamplingParams names its own field ("structured_outputs.choice: ..."); the client's
    # field is named in front instead
    name, sep, rest = message.partition(": ")
    return rest if sep and name.startswith("structured_outputs") else message


def _xgrammar_message(exc: Exception) -> str:
    # "[22:10:29] /project/cpp/regex_converter.cc:94: Regex parsing error at ...": the file
    # and time say nothing to a client
    text = str(exc).strip()
    parts = text.split(": ", 1)
    return parts[1] if len(parts) == 2 and parts[0].startswith("[") else text
