"""OpenAI's tool schemas (msgspec): the tools a request offers, the choice among them, the calls
an answer makes, and their stream deltas.

A function's name is held to OpenAI's rule (letters, digits, ``_`` and ``-``, at most 64): the
name ends up inside a grammar and a chat template, and a client's typo there is better caught as
a 400 than as a call nobody can dispatch.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

FunctionName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]


class FunctionDefinition(Struct, kw_only=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments
    strict: bool | None = None  # arguments always follow the schema here when it is enforced


class Tool(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def as_dict(self) -> dict:
        """What a chat template expects in ``tools`` (OpenAI's shape, nulls left out)."""
        function = {"name": self.function.name}
        if self.function.description is not None:
            function["description"] = self.function.description
        if self.function.parameters is not None:
            function["parameters"] = self.function.parameters
        return {"type": "function", "function": function}


class NamedFunction(Struct):
    name: FunctionName


class NamedToolChoice(Struct, kw_only=True):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Struct, omit_defaults=True):
    """A piece of call ``index``: its first chunk names it, the next ones add arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None
