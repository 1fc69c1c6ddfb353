"""What a chat request's ``tools`` and ``tool_choice`` ask of the engine: ``ToolUse``.

As in vLLM: without ``tool_choice``, a request with tools means ``auto``, and ``auto`` reads
calls out of free text with the server's ``--tool-call-parser``, so it needs
``--enable-auto-tool-choice``. ``required`` and a named function need no parser: the output is
constrained by a JSON Schema, so even a small model writes a valid call. For a named function
the output is its arguments (the function's ``parameters`` schema); for ``required`` it is a
non-empty array of ``{"name": <one of the tools>, "parameters": <that tool's arguments>}``
(one item when ``parallel_tool_calls`` is false).
``none`` passes the tools to the chat template and reads no calls.
"""

from __future__ import annotations

import asyncio
import dataclasses

import msgspec

from actorlm.api.errors import ApiError
from actorlm.api.options import ServerOptions
from actorlm.api.protocol_tools import NamedToolChoice, Tool
from actorlm.api.structured import check_constraint
from actorlm.api.tool_parsers import PARSERS, ToolParser
from actorlm.api.tool_stream import NamedCallStream, ParsedCallStream, RequiredCallStream
from actorlm.sampling_params import SamplingParams, StructuredOutputsParams

# a function without parameters is called with an empty object, as vLLM does
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclasses.dataclass(frozen=True)
class ToolUse:
    mode: str  # "none", "auto", "named" or "required"
    tools: tuple[Tool, ...] = ()
    name: str | None = None  # the named function
    parser: ToolParser | None = None  # for auto
    parallel: bool = True  # several calls in one answer (required, auto)

    @property
    def reads_calls(self) -> bool:
        return self.mode != "none"

    @property
    def reads_harmony(self) -> bool:
        """Whether the calls are harmony messages, which the reasoning parser must keep."""
        return self.mode == "auto" and self.parser.reads_harmony

    def constraint(self) -> StructuredOutputsParams | None:
        """The schema the output must follow (named and required), else None."""
        if self.mode == "named":
            function = next(t.function for t in self.tools if t.function.name == self.name)
            return StructuredOutputsParams(json=function.parameters or NO_PARAMETERS)
        if self.mode == "required":
            return StructuredOutputsParams(json=required_schema(self.tools, self.parallel))
        return None

    def sampling_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` as the calls need them: special tokens kept in the text where the
        parser's markers are special tokens (Mistral's ``[TOOL_CALLS]``), as vLLM does."""
        if self.mode == "auto" and self.parser.keeps_special_tokens:
            return msgspec.structs.replace(params, skip_special_tokens=False)
        return params

    def new_stream(self):
        """A fresh stream for one choice's output (``tool_stream``)."""
        if self.mode == "named":
            return NamedCallStream(self.name)
        if self.mode == "required":
            return RequiredCallStream()
        return ParsedCallStream(self.parser, self.parallel)


def tool_use(tools: list[Tool] | None, choice, parallel: bool | None,
             options: ServerOptions) -> ToolUse:
    tools, parallel = tuple(tools or ()), parallel is not False
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return ToolUse("none", tools)
    if not tools:
        raise ApiError(400, "tool_choice: tools must be given when tool_choice is not 'none'",
                       "tool_choice")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in {t.function.name for t in tools}:
            raise ApiError(400, f"tool_choice: the function {name!r} is not among the tools",
                           "tool_choice")
        return ToolUse("named", tools, name=name)
    if choice == "required":
        return ToolUse("required", tools, parallel=parallel)
    if not (options.enable_auto_tool_choice and options.tool_call_parser):
        raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and '
                            '--tool-call-parser to be set', "tool_choice")
    parser = PARSERS[options.tool_call_parser](tools)
    return ToolUse("auto", tools, parser=parser, parallel=parallel)


def required_schema(tools: tuple[Tool, ...], parallel: bool = True) -> dict:
    """vLLM's schema for ``required``: one or more calls (exactly one without parallel calls),
    each naming a tool and holding that tool's arguments. References into ``$defs`` of a tool's parameters keep working because the
    definitions move to the top, where ``#/$defs/...`` now points."""
    items, defs = [], {}
    for tool in tools:
        parameters = dict(tool.function.parameters or NO_PARAMETERS)
        own = parameters.pop("$defs", {})
        if not isinstance(own, dict):
            raise ApiError(400, f"tools: $defs of {tool.function.name!r} must be an object",
                           "tools")
        for name, definition in own.items():
            if defs.setdefault(name, definition) != definition:
                raise ApiError(400, f"tools: two tools define $defs/{name} differently",
                               "tools")
        items.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


async def decoding_constraint(tools: ToolUse, requested: StructuredOutputsParams | None
                              ) -> StructuredOutputsParams | None:
    """What the output is held to: the call's schema (named, required) or the request's own
    constraint; both at once cannot hold."""
    own = tools.constraint()
    if own is None:
        return requested
    if requested is not None:
        raise ApiError(400, f"tool_choice: a {tools.mode} tool call constrains the output "
                            f"already; it cannot be combined with response_format, "
                            f"structured_outputs or guided_*", "tool_choice")
    await asyncio.to_thread(check_constraint, "tools", own)
    return own
