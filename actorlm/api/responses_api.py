"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel``.

A response runs on the chat path (``serving.start_chat``): its input items become the
conversation (after the one ``previous_response_id`` names, without that one's instructions,
as OpenAI's), ``instructions`` a system message first, ``text.format`` the output constraint,
function tools the chat tools. The chat answer's think, text and calls become the output items
(reasoning, message, function calls), in that order. Streamed, the chat chunks become the
Responses events: each item added, its deltas, each item done, and ``response.completed`` (or
``response.incomplete`` at ``max_output_tokens``) with the whole response.

Answers are kept (``store``, true by default, as OpenAI's) in a bounded table in memory, the
least recently used forgotten first: ``previous_response_id`` continues their conversations,
and ``GET`` returns them; an unknown or forgotten id is a 404. A ``background`` response is
answered at once, ``queued``, and stored while it runs (``in_progress``, then as a whole
response ends); ``cancel`` stops one still running (``cancelled``, its request aborted), and
refuses any other.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from typing import AsyncIterator, NamedTuple

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from actorlm.api import protocol as p
from actorlm.api import protocol_responses as r
from actorlm.api.protocol_tools import FunctionCall, ToolCall
from actorlm.api.responses import EventStream, as_api_error, json_response
from actorlm.api.serving import start_chat
from actorlm.outputs import RequestOutput

_json = msgspec.json.Encoder()
MAX_STORED_RESPONSES = 1024
# the chat path's names of a field -> the Responses API's, for the errors a client reads
_FIELD_NAMES = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
                "messages": "input"}


class Stored(NamedTuple):
    response: r.ResponseObject
    conversation: list[p.ChatMessage]  # without its instructions, its answer last
    input_items: list[dict]  # the request's input, as ``input_items`` lists it back


class ResponseStore:
    """The stored responses, the least recently used dropped beyond ``capacity`` (used on the
    event loop only)."""

    def __init__(self, capacity: int = MAX_STORED_RESPONSES):
        self.capacity = capacity
        self._items: collections.OrderedDict[str, Stored] = collections.OrderedDict()
        self.running: dict[str, _Answer] = {}  # the background responses still running

    def cancel_running(self) -> None:
        for answer in list(self.running.values()):
            answer.cancel()

    def put(self, stored: Stored) -> None:
        self._items[stored.response.id] = stored
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str, field: str | None = None) -> Stored:
        """The stored response; a 404 naming ``field`` when it is not stored."""
        if response_id not in self._items:
            raise p.ApiError(404, f"Response with id {response_id!r} not found.", field)
        self._items.move_to_end(response_id)
        return self._items[response_id]

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._items[response_id]


async def create_response(state, request: Request) -> Response:
    req = state.decoder.decode(await request.body(), r.ResponsesRequest)
    req.check_supported()
    history = [] if req.previous_response_id is None else \
        list(state.responses.get(req.previous_response_id, "previous_response_id").conversation)
    conversation = history + r.input_messages(req)
    instructions = [] if req.instructions is None else [p.ChatMessage("system", req.instructions)]
    chat = p.ChatCompletionRequest(
        model=req.model, messages=instructions + conversation,
        max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
        top_p=req.top_p, logprobs=req.wants_logprobs,
        top_logprobs=(req.top_logprobs or 0) if req.wants_logprobs else None,
        tools=req.function_tools(), tool_choice=req.chat_tool_choice(),
        parallel_tool_calls=req.parallel_tool_calls, response_format=req.response_format(),
        top_k=req.top_k, min_p=req.min_p, repetition_penalty=req.repetition_penalty,
        seed=req.seed, priority=req.priority, cache_salt=req.cache_salt, stream=req.stream,
        reasoning_effort=req.reasoning_effort,
        stream_options=p.StreamOptions(include_usage=True) if req.stream else None)
    try:
        gen = await start_chat(state, request, chat, "Responses API", "resp")
    except p.ApiError as exc:
        raise _in_responses_terms(exc) from None
    answer = _Answer(state, req, gen, conversation)
    if req.background:
        return json_response(answer.in_background())
    if req.stream:
        return EventStream(answer.events(), gen.abort)
    return await gen.respond(request, answer.whole)


async def cancel_response(state, request: Request) -> Response:
    response_id = request.path_params["response_id"]
    stored = state.responses.get(response_id)
    answer = state.responses.running.get(response_id)
    if answer is None:
        what = "only a background response can be cancelled" if not stored.response.background \
            else f"this response is already {stored.response.status}"
        raise p.ApiError(400, f"Cannot cancel response {response_id!r}: {what}.")
    answer.cancel()
    return json_response(answer.response)


async def retrieve_response(state, request: Request) -> Response:
    return json_response(state.responses.get(request.path_params["response_id"]).response)


async def list_input_items(state, request: Request) -> Response:
    """A stored response's input items, a page at a time (OpenAI's ``limit``, ``order``
    and ``after``; newest first by default)."""
    items = state.responses.get(request.path_params["response_id"]).input_items
    page = r.ItemPage.of(request.query_params)
    ordered = items[::-1] if page.order == "desc" else items
    start = 0
    if page.after is not None:
        start = next((i + 1 for i, item in enumerate(ordered) if item["id"] == page.after), -1)
        if start < 0:
            raise p.ApiError(400, f"after: no input item {page.after!r} in this response",
                             "after")
    data = ordered[start:start + page.limit]
    return json_response({"object": "list", "data": data,
                          "first_id": data[0]["id"] if data else None,
                          "last_id": data[-1]["id"] if data else None,
                          "has_more": start + page.limit < len(ordered)})


async def delete_response(state, request: Request) -> Response:
    response_id = request.path_params["response_id"]
    state.responses.delete(response_id)
    return json_response(r.DeletedResponse(response_id))


def _in_responses_terms(exc: p.ApiError) -> p.ApiError:
    """The chat path's error with the Responses API's names of its fields."""
    message, param = exc.message, exc.param
    for chat_name, name in _FIELD_NAMES.items():
        message = message.replace(chat_name, name)
        if param is not None and param.startswith(chat_name):
            param = name + param[len(chat_name):]
    return p.ApiError(exc.status, message, param, exc.headers, exc.error_type)


class _Answer:
    """One response: its object (output items added as they come) and how it is answered,
    whole or as events."""

    def __init__(self, state, req: r.ResponsesRequest, gen, conversation: list[p.ChatMessage]):
        self.state, self.req, self.gen, self.conversation = state, req, gen, conversation
        text_format = req.text.format if req.text is not None else None
        self.response = r.ResponseObject(
            id=f"resp_{uuid.uuid4().hex}", created_at=int(time.time()), status="in_progress",
            instructions=req.instructions, max_output_tokens=req.max_output_tokens,
            model=gen.model_name, output=[],
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id, temperature=req.temperature,
            top_p=req.top_p, tool_choice=req.tool_choice or "auto", tools=req.tools or [],
            text={"format": msgspec.to_builtins(text_format or r.TextFormat(type="text"))},
            store=req.store is not False, metadata=req.metadata, user=req.user)

    # --- in the background ---------------------------------------------------------------

    def in_background(self) -> r.ResponseObject:
        """The response queued and stored at once; it runs on, to be retrieved or cancelled."""
        response = self.response
        response.status, response.background = "queued", True
        self.state.responses.put(Stored(response, self.conversation, r.input_items(self.req)))
        self.state.responses.running[response.id] = self
        self.task = asyncio.create_task(self._run())
        return response

    async def _run(self) -> None:
        self.response.status = "in_progress"
        try:
            self.whole(await self.gen.finals())
        except asyncio.CancelledError:
            pass  # (cancel said so)
        except Exception as exc:
            error = as_api_error(exc)
            self.response.status = "failed"
            self.response.error = {"code": error.response().error.type, "message": error.message}
        finally:
            self.state.responses.running.pop(self.response.id, None)

    def cancel(self) -> None:
        self.gen.abort()
        self.task.cancel()
        self.response.status = "cancelled"
        self.state.responses.running.pop(self.response.id, None)

    # --- whole -------------------------------------------------------------------------------

    def whole(self, finals: list[RequestOutput]) -> r.ResponseObject:
        choice = self.gen.chat_response(finals).choices[0]
        message = choice.message
        if message.reasoning_content:
            self.response.output.append(_reasoning_item(message.reasoning_content))
        calls = [_call_item(c.id, c.function.name, c.function.arguments)
                 for c in message.tool_calls or ()]
        if message.content or not (calls or self.response.output):  # (said nothing: "")
            logprobs = choice.logprobs.content if choice.logprobs is not None else None
            self.response.output.append(_message_item(message.content or "", logprobs))
        self.response.output += calls
        return self._finish(finals[0], choice.finish_reason)

    def _finish(self, final: RequestOutput, finish_reason: str | None) -> r.ResponseObject:
        """The response complete (or cut at ``max_output_tokens``), with its usage; stored."""
        response = self.response
        if finish_reason == "length":
            response.status = "incomplete"
            response.incomplete_details = r.IncompleteDetails("max_output_tokens")
        else:
            response.status = "completed"
        usage = self.gen.usage([final])
        response.usage = r.ResponseUsage(
            usage.prompt_tokens, r.InputTokensDetails(usage.prompt_tokens_details.cached_tokens),
            usage.completion_tokens, r.OutputTokensDetails(self._reasoning_tokens(final)),
            usage.total_tokens)
        if response.store:
            self.state.responses.put(Stored(response, self.conversation + [self._said()],
                                            r.input_items(self.req)))
        return response

    def _reasoning_tokens(self, final: RequestOutput) -> int:
        think = self.gen.reasoning
        if think is None:
            return 0
        gate = think.gate(think.initial_phase(final.prompt_token_ids))
        return sum(not gate.on_token(t) for t in final.outputs[0].token_ids)

    def _said(self) -> p.ChatMessage:
        """The answer as the next turn's history holds it: its text and calls (its think
        left out, as chat templates leave a past one out)."""
        text = "".join(part.text for item in self.response.output
                       if isinstance(item, r.OutputMessage) for part in item.content)
        calls = [ToolCall(id=item.call_id, function=FunctionCall(item.name, item.arguments))
                 for item in self.response.output if isinstance(item, r.OutputFunctionCall)]
        return p.ChatMessage("assistant", text, tool_calls=calls or None)

    # --- streamed ----------------------------------------------------------------------------

    async def events(self) -> AsyncIterator[bytes]:
        events = _Events(self.response)
        yield events.emit("response.created", response=self.response)
        yield events.emit("response.in_progress", response=self.response)
        finish_reason = None
        try:
            async for chunk in self.gen.chat_chunks():
                for choice in chunk.choices:
                    delta = choice.delta
                    logprobs = choice.logprobs.content if choice.logprobs is not None else None
                    for data in events.deltas(delta.reasoning_content, delta.content,
                                              delta.tool_calls, logprobs):
                        yield data
                    finish_reason = choice.finish_reason or finish_reason
            for data in events.close(empty_message=not self.response.output):
                yield data
            response = self._finish(self.gen.final, finish_reason)
            kind = "incomplete" if response.status == "incomplete" else "completed"
            yield events.emit(f"response.{kind}", response=response)
        except Exception as exc:
            error = as_api_error(exc)
            self.response.status = "failed"
            self.response.error = {"code": error.response().error.type, "message": error.message}
            yield events.emit("error", code=self.response.error["code"], message=error.message,
                              param=error.param)
            yield events.emit("response.failed", response=self.response)


class _Events:
    """The Responses API's events of one streamed answer, from its chat deltas: the item being
    written (a think, a message, a call) stays open until another kind of item begins."""

    def __init__(self, response: r.ResponseObject):
        self.response = response
        self.sequence = 0
        self.item = None  # the open item
        self.pieces: list[str] = []  # its text or arguments so far
        self.logprobs: list = []

    def emit(self, kind: str, **fields) -> bytes:
        data = _json.encode({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def deltas(self, think: str | None, text: str | None, calls, logprobs) -> list[bytes]:
        out = []
        if think:
            out += self._open(r.OutputReasoning, lambda: _reasoning_item("", "in_progress"))
            out.append(self._delta("response.reasoning_text.delta", think, content_index=0))
        if text:
            out += self._open(r.OutputMessage, lambda: _message_item(None, None, "in_progress"))
            self.logprobs += logprobs or []
            out.append(self._delta("response.output_text.delta", text, content_index=0,
                                   logprobs=logprobs or []))
        for call in calls or ():
            if call.id is not None:  # a new call
                out += self.close()
                name = call.function.name if call.function is not None else ""
                out += self._open(r.OutputFunctionCall,
                                  lambda: _call_item(call.id, name, "", "in_progress"))
            arguments = call.function.arguments if call.function is not None else None
            if arguments:
                out.append(self._delta("response.function_call_arguments.delta", arguments))
        return out

    def _open(self, kind: type, make) -> list[bytes]:
        if isinstance(self.item, kind) and kind is not r.OutputFunctionCall:
            return []
        out = self.close()
        self.item = make()
        self.response.output.append(self.item)
        out.append(self.emit("response.output_item.added", output_index=self._index(),
                             item=self.item))
        if kind is r.OutputMessage:
            out.append(self.emit("response.content_part.added", item_id=self.item.id,
                                 output_index=self._index(), content_index=0,
                                 part=r.OutputText("")))
        return out

    def _delta(self, kind: str, piece: str, **fields) -> bytes:
        self.pieces.append(piece)
        return self.emit(kind, item_id=self.item.id, output_index=self._index(), delta=piece,
                         **fields)

    def close(self, empty_message: bool = False) -> list[bytes]:
        """The open item done (an empty message first where the answer said nothing)."""
        if self.item is None and empty_message:
            out = self._open(r.OutputMessage, lambda: _message_item(None, None, "in_progress"))
            return out + self.close()
        item, text = self.item, "".join(self.pieces)
        if item is None:
            return []
        at = dict(item_id=item.id, output_index=self._index())
        out = []
        if isinstance(item, r.OutputReasoning):
            item.content = [r.ReasoningText(text)]
            out.append(self.emit("response.reasoning_text.done", **at, content_index=0,
                                 text=text))
        elif isinstance(item, r.OutputMessage):
            part = r.OutputText(text, logprobs=self.logprobs if self.logprobs else None)
            item.content = [part]
            out.append(self.emit("response.output_text.done", **at, content_index=0, text=text,
                                 logprobs=self.logprobs))
            out.append(self.emit("response.content_part.done", **at, content_index=0,
                                 part=part))
        else:
            item.arguments = text
            out.append(self.emit("response.function_call_arguments.done", **at, name=item.name,
                                 arguments=text))
        item.status = "completed"
        out.append(self.emit("response.output_item.done", output_index=self._index(),
                             item=item))
        self.item, self.pieces, self.logprobs = None, [], []
        return out

    def _index(self) -> int:
        return len(self.response.output) - 1


def _message_item(text: str | None, logprobs, status: str = "completed") -> r.OutputMessage:
    content = [] if text is None else [r.OutputText(text, logprobs=logprobs)]
    return r.OutputMessage(id=f"msg_{uuid.uuid4().hex}", status=status, content=content)


def _reasoning_item(text: str, status: str = "completed") -> r.OutputReasoning:
    return r.OutputReasoning(id=f"rs_{uuid.uuid4().hex}", status=status,
                             content=[r.ReasoningText(text)] if text else [])


def _call_item(call_id: str, name: str, arguments: str,
               status: str = "completed") -> r.OutputFunctionCall:
    return r.OutputFunctionCall(id=f"fc_{uuid.uuid4().hex}", call_id=call_id, name=name,
                                arguments=arguments, status=status)
