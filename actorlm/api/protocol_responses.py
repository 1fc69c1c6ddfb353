"""OpenAI's Responses API schemas (msgspec): the request ``POST /v1/responses`` decodes, the
input items it reads into a conversation, and the response object it answers with (stored for
``GET /v1/responses/{id}`` and ``previous_response_id``).

A request's input is a text (one user message) or a list of items: messages (text parts only),
the function calls an earlier answer made and their outputs; an earlier answer's reasoning
items are left out, as chat templates leave a past think out. Tools are functions; OpenAI's
built-in tools (web search, file search, code interpreter…) and the fields this server does not
implement (``truncation: auto``, ``include`` beyond logprobs, ``conversation``, ``prompt``,
``max_tool_calls``, ``background`` with ``stream`` or without ``store``, ``reasoning`` but its
effort, ``text.verbosity``) are refused by name; ``reasoning.effort`` is the chat template's
``reasoning_effort``, as chat's is.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from actorlm.api.errors import ApiError
from actorlm.api.protocol import REASONING_EFFORTS, ChatLogprobToken, ChatMessage
from actorlm.api.protocol_tools import (FunctionCall, FunctionDefinition, FunctionName,
                                        NamedFunction, NamedToolChoice, Tool, ToolCall, ToolChoice)
from actorlm.api.structured import JsonSchemaFormat, ResponseFormat

# what ``include`` may ask for: the output text's logprobs (with ``top_logprobs``)
LOGPROBS_INCLUDE = "message.output_text.logprobs"


# --- the request -----------------------------------------------------------------------------


class TextFormat(Struct, kw_only=True, omit_defaults=True, rename={"schema_": "schema"}):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = None
    strict: bool | None = None  # the schema is always enforced


class TextConfig(Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # refused: nothing here sets an answer's length by it


class FunctionTool(Struct, kw_only=True):
    """A function, as the Responses API spells it (flat, not under ``function``)."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Part(Struct, kw_only=True):
    """A message's content part: text (``input_text``, or an earlier answer's
    ``output_text``); images, files and audio are refused."""

    type: str
    text: str | None = None


class _Message(Struct, kw_only=True):
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[_Part]


class _FunctionCall(Struct, kw_only=True):
    call_id: str
    name: FunctionName
    arguments: str


class _FunctionCallOutput(Struct, kw_only=True):
    call_id: str
    output: str | list[_Part]


_ITEMS = {"message": _Message, "function_call": _FunctionCall,
          "function_call_output": _FunctionCallOutput}


class ResponsesRequest(Struct, kw_only=True):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None  # a system message first; not carried to the next turn
    previous_response_id: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: Annotated[int, Meta(ge=0)] | None = None  # at most --max-logprobs
    stream: bool | None = False
    store: bool | None = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    # OpenAI's, refused when on (``check_supported``)
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = None
    reasoning: dict[str, Any] | None = None  # its effort only (``reasoning_effort``)
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    priority: Annotated[int, Meta(ge=-2**63, le=2**63 - 1)] = 0
    cache_salt: Annotated[str, Meta(min_length=1)] | None = None

    def check_supported(self) -> None:
        """A 400 naming the first field this request turns on that is not implemented."""
        if self.background and self.stream:
            raise ApiError(400, "background: a background response is not streamed here "
                                "(retrieve it by id)", "background")
        if self.background and self.store is False:
            raise ApiError(400, "background: a background response must be stored "
                                "(store: true)", "background")
        refused = {"truncation": self.truncation == "auto",
                   "max_tool_calls": self.max_tool_calls is not None,
                   # the effort goes to the chat template (``reasoning_effort``); the SDKs
                   # send nulls for "no preference"
                   **{f"reasoning.{k}": v is not None for k, v in (self.reasoning or {}).items()
                      if k != "effort"},
                   "conversation": self.conversation,
                   "prompt": self.prompt,
                   "text.verbosity": self.text is not None and self.text.verbosity}
        for name, on in refused.items():
            if on:
                raise ApiError(400, f"{name}: not supported by this server", name)
        if self.reasoning_effort not in (None, *REASONING_EFFORTS):
            raise ApiError(400, f"reasoning.effort: one of {', '.join(REASONING_EFFORTS)}, got "
                                f"{self.reasoning_effort!r}", "reasoning.effort")
        for i, item in enumerate(self.include or ()):
            if item != LOGPROBS_INCLUDE:
                raise ApiError(400, f"include[{i}]: {item!r} is not supported by this server "
                                    f"(only {LOGPROBS_INCLUDE!r})", f"include[{i}]")

    @property
    def reasoning_effort(self) -> Any:
        return (self.reasoning or {}).get("effort")

    def function_tools(self) -> list[Tool] | None:
        """The tools as the chat path takes them; a built-in tool is a 400 naming it."""
        if self.tools is None:
            return None
        tools = []
        for i, raw in enumerate(self.tools):
            if raw.get("type") != "function":
                raise ApiError(400, f"tools[{i}].type: {raw.get('type')!r} is not supported by "
                                    f"this server (only 'function')", f"tools[{i}].type")
            tool = _convert(raw, FunctionTool, f"tools[{i}]")
            tools.append(Tool(function=FunctionDefinition(
                name=tool.name, description=tool.description, parameters=tool.parameters,
                strict=tool.strict)))
        return tools

    def chat_tool_choice(self) -> ToolChoice | None:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") != "function":
            raise ApiError(400, f"tool_choice.type: {choice.get('type')!r} is not supported by "
                                f"this server (only 'function')", "tool_choice.type")
        named = _convert(choice, FunctionTool, "tool_choice")
        return NamedToolChoice(function=NamedFunction(named.name))

    def response_format(self) -> ResponseFormat | None:
        """``text.format`` as the chat path's ``response_format``."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        schema = None if fmt.type == "json_object" else JsonSchemaFormat(
            name=fmt.name, description=fmt.description, schema_=fmt.schema_, strict=fmt.strict)
        return ResponseFormat(type=fmt.type, json_schema=schema)

    @property
    def wants_logprobs(self) -> bool:
        return self.top_logprobs is not None or LOGPROBS_INCLUDE in (self.include or ())


def input_messages(request: ResponsesRequest) -> list[ChatMessage]:
    """The request's input as chat messages: a text is one user message; a developer message
    is a system one; consecutive function calls are one assistant message with those calls
    (joined to the assistant's text before them), their outputs tool messages."""
    if isinstance(request.input, str):
        return [ChatMessage("user", request.input)]
    messages: list[ChatMessage] = []
    for i, raw in enumerate(request.input):
        kind = raw.get("type", "message")
        if kind == "reasoning":
            continue
        if kind not in _ITEMS:
            raise ApiError(400, f"input[{i}].type: {kind!r} is not supported by this server",
                           f"input[{i}].type")
        item = _convert(raw, _ITEMS[kind], f"input[{i}]")
        if isinstance(item, _Message):
            role = "system" if item.role == "developer" else item.role
            messages.append(ChatMessage(role, _text(item.content, f"input[{i}].content")))
        elif isinstance(item, _FunctionCall):
            call = ToolCall(id=item.call_id, function=FunctionCall(item.name, item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or ()), call]
            else:
                messages.append(ChatMessage("assistant", None, tool_calls=[call]))
        else:
            messages.append(ChatMessage("tool", _text(item.output, f"input[{i}].output"),
                                        tool_call_id=item.call_id))
    return messages


# the prefix of an input item's id, by its type (OpenAI's)
_ITEM_IDS = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
             "reasoning": "rs"}


def input_items(request: ResponsesRequest) -> list[dict]:
    """The request's input as ``input_items`` lists it back: a text as one user message of
    ``input_text``, every item with an id (its own, or a new one) and a message's text
    content as a part."""
    raw = [{"type": "message", "role": "user", "content": request.input}] \
        if isinstance(request.input, str) else request.input
    items = []
    for item in raw:
        item = {"type": "message", **item}
        item.setdefault("id", f"{_ITEM_IDS.get(item['type'], 'item')}_{uuid.uuid4().hex}")
        if item["type"] == "message":
            item.setdefault("status", "completed")
            if isinstance(item.get("content"), str):
                kind = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": kind, "text": item["content"]}]
        items.append(item)
    return items


class ItemPage(Struct, kw_only=True):
    """``input_items``' query: ``limit`` items (1 to 100) ``after`` an item's id, in
    ``order``."""

    limit: int = 20
    order: Literal["asc", "desc"] = "desc"
    after: str | None = None

    @classmethod
    def of(cls, query) -> ItemPage:
        try:
            page = cls(limit=int(query.get("limit", 20)), order=query.get("order", "desc"),
                       after=query.get("after"))
        except ValueError:
            raise ApiError(400, f"limit: an integer from 1 to 100, got {query.get('limit')!r}",
                           "limit") from None
        if not 1 <= page.limit <= 100:
            raise ApiError(400, f"limit: an integer from 1 to 100, got {page.limit}", "limit")
        if page.order not in ("asc", "desc"):
            raise ApiError(400, f"order: asc or desc, got {page.order!r}", "order")
        return page


def _text(content: str | list[_Part], field: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in ("input_text", "output_text") or part.text is None:
            raise ApiError(400, f"{field}[{j}]: only text parts are supported, got "
                                f"{part.type!r}", f"{field}[{j}]")
        texts.append(part.text)
    return "\n".join(texts)


def _convert(raw: dict, type_: type, field: str):
    try:
        return msgspec.convert(raw, type_)
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"{field}: {exc}", field) from None


# --- the response ----------------------------------------------------------------------------


class OutputText(Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = []
    logprobs: list[ChatLogprobToken] | None = None


class OutputMessage(Struct, tag_field="type", tag="message", kw_only=True):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(Struct, tag_field="type", tag="function_call", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningText(Struct, tag_field="type", tag="reasoning_text"):
    text: str


class OutputReasoning(Struct, tag_field="type", tag="reasoning", kw_only=True):
    id: str
    summary: list[Any] = []
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class InputTokensDetails(Struct):
    cached_tokens: int


class OutputTokensDetails(Struct):
    reasoning_tokens: int


class ResponseUsage(Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseObject(Struct, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None
    temperature: float | None
    top_p: float | None
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    truncation: Literal["disabled"] = "disabled"
    store: bool
    metadata: dict[str, str] | None
    usage: ResponseUsage | None = None
    background: bool = False
    user: str | None = None


class DeletedResponse(Struct):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
