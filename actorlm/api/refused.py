"""Fields that vLLM or OpenAI define and actorlm does not implement: refused, never dropped.

A client that asks for JSON output, tools or beam search and silently gets plain sampling
draws wrong conclusions from a 200. These fields are declared (so the schema shows them and
they decode strictly) and a request that uses one gets a 400 naming it. Sent with their
"off" value (``null``, ``false``, ``0``, empty, ``{"type": "text"}``, ``tool_choice:
"none"``) they change nothing and pass. Fields nobody defines are another matter: they are
ignored and logged once (``decoding.RequestDecoder``).
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct

from actorlm.api.errors import ApiError

# fields a chat request may carry besides RefusedFields'
CHAT_FIELDS = ("tools", "tool_choice", "functions", "function_call", "documents")
# "off" values that are not simply falsy
_OFF = {"response_format": lambda v: v.type == "text", "tool_choice": lambda v: v == "none",
        "function_call": lambda v: v == "none"}


class ResponseFormat(Struct, kw_only=True):
    type: str
    json_schema: dict[str, Any] | None = None


class RefusedFields(Struct, kw_only=True):
    """Structured outputs, beam search and the like, for completions and chat alike."""

    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    use_beam_search: bool | None = False
    logits_processors: list[Any] | None = None
    priority: int | None = 0  # only the first-come, first-served policy exists
    cache_salt: str | None = None

    def check_refused(self, extra: tuple[str, ...] = ()) -> None:
        """Raise a 400 naming the first unimplemented field this request turns on."""
        for name in (*RefusedFields.__struct_fields__, *extra):
            value = getattr(self, name)
            if value and not _OFF.get(name, _never)(value):
                hint = " (only {\"type\": \"text\"})" if name == "response_format" else ""
                raise ApiError(400, f"{name}: not supported by this server{hint}", name)


def _never(value) -> bool:
    return False
