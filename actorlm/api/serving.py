"""Completions and chat completions: from a decoded request to a JSON answer or an SSE stream.

A request's path: validate (fields actorlm does not implement are refused; a constraint on the
output must be a valid schema, regex or grammar), refuse text that cannot fit the context before
tokenizing it, tokenize (the chat template for chat, with the request's tools), truncate if
asked and check prompt + max_tokens against the context like vLLM, build SamplingParams (their
ValueError is a 400), submit one engine request per prompt, then either collect the final
outputs or stream Server-Sent Events: chunks carry the text (and logprobs) added since the
previous chunk, ``finish_reason`` rides on a choice's last chunk, a usage chunk with empty
``choices`` follows when asked, and ``data: [DONE]`` ends the stream. An error after the stream
has started is sent as an error event before ``[DONE]``. Both kinds of answer watch the
connection: a client that hangs up aborts its requests at once (the engine finishes them as
``abort`` and frees their blocks). Sampling fields a request leaves out take the model's
defaults (``--generation-config``). A ``model`` that names a LoRA adapter runs every prompt
with it (``lora_models``), and the answer names the adapter. In chat, with
``--reasoning-parser``, each choice's think is split out first (``reasoning``:
``reasoning_content``, whole or as it streams); tool calls are then read out of the rest by its
``tool_stream`` (``tool_choice``). A pooling model's server refuses both routes, as vLLM's
does (it serves ``/v1/embeddings``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import AsyncIterator, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from actorlm.api import protocol as p
from actorlm.api.chat_template import apply_chat_template, template_call
from actorlm.api.logprobs import chat_logprobs, completion_logprobs, prompt_logprobs
from actorlm.api.prompt_limits import (check_text_length, check_token_ids, max_tokens_for,
                                       truncated)
from actorlm.api.request_log import RequestLog
from actorlm.api.responses import DONE, EventStream, error_event, event, json_response
from actorlm.api.structured import checked_constraint
from actorlm.api.tool_choice import ToolUse, decoding_constraint, tool_use
from actorlm.api.tool_stream import collect
from actorlm.async_llm import AsyncLLM, RequestStream
from actorlm.beam_search import BeamSearchParams
from actorlm.lora_request import LoRARequest
from actorlm.outputs import RequestOutput
from actorlm.prompt_rules import empty_prompt
from actorlm.reasoning import ThinkTokens, split_reasoning

log = logging.getLogger(__name__)


async def create_completion(state, request: Request) -> Response:
    engine = _generating_engine(state, "Completions API")
    req = state.decoder.decode(await request.body(), p.CompletionRequest)
    lora = state.resolve_model(req.model)
    req.check_supported()
    prompts = req.prompts()
    add_special = p.or_default(req.add_special_tokens, True)
    for prompt in prompts:
        if isinstance(prompt, str):
            check_text_length(state, len(prompt), req)
        else:
            check_token_ids(engine, prompt, "prompt")
    prompt_ids = await engine.run_blocking(
        lambda: [engine.encode(x, add_special) if isinstance(x, str) else x for x in prompts])
    if any(not ids for ids in prompt_ids):
        raise p.ApiError(400, empty_prompt("prompt"), "prompt")
    prompt_ids = [truncated(ids, req.truncate_prompt_tokens, engine.max_model_len,
                            req.truncation_side)
                  for ids in prompt_ids]
    constraint = await checked_constraint(req)
    defaults = engine.sampling_defaults
    requested = 1 if req.echo_only else req.max_tokens
    params = [req.sampling_params(max_tokens_for(len(ids), requested, engine.max_model_len,
                                                 default=defaults.get("max_tokens", None)),
                                  req.logprobs, constraint, defaults) for ids in prompt_ids]
    echo = None
    if req.echo:
        echo = await engine.run_blocking(
            lambda: [x if isinstance(x, str) else engine.decode(x) for x in prompts])
    beams = req.beam_search(params[0], constraint is not None, engine.config.max_logprobs)
    gen = _Generation(engine, _model_name(state, lora), "cmpl", request, req, state.options,
                      lora=lora)
    await gen.start(prompt_ids, params, beams)
    if req.stream:
        return EventStream(gen.completion_events(echo), gen.abort)
    return await gen.respond(request, lambda finals: gen.completion_response(finals, echo))


async def create_chat_completion(state, request: Request) -> Response:
    req = state.decoder.decode(await request.body(), p.ChatCompletionRequest)
    gen = await start_chat(state, request, req, "Chat Completions API", "chatcmpl")
    if req.stream:
        return EventStream(gen.chat_events(), gen.abort)
    return await gen.respond(request, gen.chat_response)


async def start_chat(state, request: Request, req: p.ChatCompletionRequest, api: str,
                     kind: str) -> _Generation:
    """The chat request ``req`` checked, rendered by the chat template and started: its
    generation, to answer with (the Chat Completions API's shape, or the Responses API's)."""
    engine = _generating_engine(state, api)
    lora = state.resolve_model(req.model)
    req.check_supported()
    tools = tool_use(req.tools, req.tool_choice, req.parallel_tool_calls, state.options)
    constraint = await decoding_constraint(tools, await checked_constraint(req))
    add_generation_prompt, kwargs = template_call(req, state.options, True)
    if req.tools:
        kwargs["tools"] = [t.as_dict() for t in req.tools]
    conversation = req.conversation()
    check_text_length(state, p.num_chars(req.messages, conversation), req)
    ids = await apply_chat_template(engine, conversation, add_generation_prompt, **kwargs)
    ids = truncated(ids, req.truncate_prompt_tokens, engine.max_model_len, req.truncation_side)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    defaults = engine.sampling_defaults
    max_tokens = max_tokens_for(len(ids), req.requested_max_tokens, engine.max_model_len, field,
                                defaults.get("max_tokens", None))
    if (top := req.num_logprobs) is not None and top > engine.max_logprobs:
        raise p.ApiError(400, f"top_logprobs: at most {engine.max_logprobs} are supported "
                              f"(--max-logprobs), got {top}", "top_logprobs")
    params = tools.sampling_params(req.sampling_params(max_tokens, top, constraint, defaults))
    if engine.reasoning is not None and engine.reasoning.tags_are_special:
        params = msgspec.structs.replace(params, skip_special_tokens=False)  # the tags to split on
    beams = req.beam_search(params, constraint is not None, engine.config.max_logprobs)
    # vLLM's: the answer's role is the server's, unless it continues the last message
    role = state.options.response_role if add_generation_prompt else req.messages[-1].role
    gen = _Generation(engine, _model_name(state, lora), kind, request, req, state.options,
                      tools, engine.reasoning, lora, role)
    await gen.start([ids], [params], beams)
    return gen


def _generating_engine(state, api: str) -> AsyncLLM:
    """The engine, unless its model pools (embeddings only): then vLLM's 400."""
    engine = state.ready_engine()
    if engine.config.is_pooling:
        raise p.ApiError(400, f"The model does not support {api}")
    return engine


def _model_name(state, lora: LoRARequest | None) -> str:
    """The ``model`` an answer names: the adapter's, as vLLM's do, else the base model's."""
    return state.model_name if lora is None else lora.lora_name


class _Progress:
    """What one choice has sent so far while streaming."""

    __slots__ = ("text_len", "num_tokens", "finished", "text_offset")

    def __init__(self):
        self.text_len = self.num_tokens = self.text_offset = 0
        self.finished = False

    def advance(self, c, interval: int = 1) -> tuple[str, int, int] | None:
        """(new text, first new token, end) since the last call; None when nothing is new, or
        fewer than ``interval`` new tokens after the first ones (until the last: they wait for
        the next call, ``--stream-interval``)."""
        if self.finished:
            return None
        finished = c.finish_reason is not None
        if not finished and self.num_tokens and len(c.token_ids) - self.num_tokens < interval:
            return None
        # the frontend's cumulative text only grows: it holds back half characters and
        # text that could still begin a stop string
        text = c.text[self.text_len:]
        start, end = self.num_tokens, len(c.token_ids)
        if not text and start == end and not finished:
            return None
        self.text_len, self.num_tokens = max(self.text_len, len(c.text)), end
        self.finished = finished
        return text, start, end


class _Generation:
    """One API request's engine requests (one per prompt) and how to answer with them."""

    def __init__(self, engine: AsyncLLM, model_name: str, kind: str, request: Request, req,
                 options, tools: ToolUse | None = None, reasoning: ThinkTokens | None = None,
                 lora: LoRARequest | None = None, role: str = "assistant"):
        self.engine, self.model_name, self.req = engine, model_name, req
        self.role = role  # of a chat answer
        # how logprobs write a token: its text, or as its id (None, ``logprobs``)
        as_ids = p.or_default(req.return_tokens_as_token_ids, options.return_tokens_as_token_ids)
        self.token_text = None if as_ids else engine.decode
        self.echo_only = isinstance(req, p.CompletionRequest) and req.echo_only
        self.lora = lora  # the adapter every prompt runs with; None: the base model
        self.tools = tools if tools is not None and tools.reads_calls else None
        self.reasoning = reasoning  # chat with --reasoning-parser: split the think out
        # the fewest new tokens a streamed chunk carries (but a choice's first and last)
        self.stream_interval = max(options.stream_interval, req.stream_interval or 1)
        self.prompt_token_ids: list[list[int]] = []
        # the API id carries the X-Request-Id; the engine's must be unique whatever clients
        # send, so a client's id gets a random suffix there
        self.request_id = f"{kind}-{request.state.request_id}"
        self.engine_id = self.request_id
        if request.state.request_id_from_client:
            self.engine_id += f"-{uuid.uuid4().hex[:8]}"
        self.created = int(time.time())
        self.n = p.or_default(req.n, 1)
        # a stream's closing usage chunk: asked for, or forced by the operator
        self.include_usage = req.include_usage or (options.force_include_usage and
                                                   bool(req.stream))
        self.streams: list[RequestStream] = []
        self.final: RequestOutput | None = None  # the last output a stream of chunks read
        self.request_log = RequestLog(options.log_requests, options.log_outputs,
                                      options.max_log_len, engine.decode)

    async def start(self, prompt_ids: list[list[int]], params: list,
                    beams: BeamSearchParams | None = None) -> None:
        """Start every prompt's request (``beams``: a beam search each, in their place)."""
        self.prompt_token_ids = prompt_ids
        try:
            for i, (ids, sp) in enumerate(zip(prompt_ids, params)):
                rid = self.engine_id if len(prompt_ids) == 1 else f"{self.engine_id}-{i}"
                prompt = ids if self.req.cache_salt is None else \
                    {"prompt_token_ids": ids, "cache_salt": self.req.cache_salt}
                self.request_log.received(rid, ids, sp if beams is None else beams, self.lora)
                self.streams.append(
                    await self.engine.add_request(rid, prompt, sp, self.lora, self.req.priority)
                    if beams is None else
                    await self.engine.add_beam_search(rid, prompt, beams, self.lora,
                                                      self.req.priority))
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as they arrive from every prompt's request."""
        if len(self.streams) == 1:
            async for out in self.streams[0]:
                yield 0, self._answer(out)
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except Exception as exc:
                queue.put_nowait((i, exc))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, self._answer(item)
        finally:
            for task in tasks:
                task.cancel()

    def _answer(self, out: RequestOutput) -> RequestOutput:
        """An engine output checked, as the client gets it, logged where asked."""
        out = self._delivered(_checked(out))
        self.request_log.answered(out)
        return out

    def _delivered(self, out: RequestOutput) -> RequestOutput:
        """``out`` as the client gets it: echo without generation (``echo_only``) drops the
        one token the engine computed, so the answer is the prompt alone."""
        if not self.echo_only:
            return out
        kept = [dataclasses.replace(c, token_ids=[], text="", cumulative_logprob=0.0,
                                    logprobs=None if c.logprobs is None else [])
                for c in out.outputs]
        return dataclasses.replace(out, outputs=kept)

    async def finals(self) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(self.streams)
        async for i, out in self.outputs():
            finals[i] = out
        return finals

    async def respond(self, request: Request, build: Callable) -> Response:
        """Collect the final outputs unless the client hangs up first (then abort)."""
        work = asyncio.ensure_future(self.finals())
        if not await unless_disconnected(request, work):
            self.abort()
            log.info("%s: client disconnected; aborted", self.engine_id)
            return Response(status_code=499)
        return json_response(build(work.result()))

    def usage(self, finals: list[RequestOutput]) -> p.UsageInfo:
        num_prompt = sum(len(f.prompt_token_ids) for f in finals)
        num_completion = sum(len(c.token_ids) for f in finals for c in f.outputs)
        cached = sum(f.num_cached_tokens for f in finals)
        return p.UsageInfo(num_prompt, num_completion, num_prompt + num_completion,
                           p.PromptTokensDetails(cached))

    # --- completions ---------------------------------------------------------------------------

    def completion_response(self, finals: list[RequestOutput], echo) -> p.CompletionResponse:
        choices = []
        for i, final in enumerate(finals):
            prefix = echo[i] if echo else ""
            for c in final.outputs:
                lp = None
                if self.req.logprobs is not None and c.logprobs is not None:
                    ids, positions, offset = c.token_ids, c.logprobs, len(prefix)
                    if echo and final.prompt_logprobs is not None:  # the prompt's first
                        ids, positions = final.prompt_token_ids + ids, \
                            final.prompt_logprobs + positions
                        offset = 0
                    lp = completion_logprobs(ids, positions, self.req.logprobs,
                                             self.token_text, offset)
                with_ids = self.req.return_token_ids
                choices.append(p.CompletionChoice(i * self.n + c.index, prefix + c.text, lp,
                                                  c.finish_reason, c.stop_reason,
                                                  prompt_logprobs(final.prompt_logprobs),
                                                  final.prompt_token_ids if with_ids else None,
                                                  list(c.token_ids) if with_ids else None))
        return p.CompletionResponse(self.request_id, "text_completion", self.created,
                                    self.model_name, choices, self.usage(finals))

    async def completion_events(self, echo) -> AsyncIterator[bytes]:
        progress = [[_Progress() for _ in range(self.n)] for _ in self.streams]
        finals: list[RequestOutput | None] = [None] * len(self.streams)
        continuous = self.req.continuous_usage
        try:
            async for i, out in self.outputs():
                finals[i] = out
                for c in out.outputs:
                    prog = progress[i][c.index]
                    step = prog.advance(c, self.stream_interval)
                    if step is None:
                        continue
                    text, start, end = step
                    if echo and start == 0 and prog.text_offset == 0:
                        text, prog.text_offset = echo[i] + text, len(echo[i])
                    lp = None
                    if self.req.logprobs is not None and c.logprobs is not None:
                        lp = completion_logprobs(c.token_ids[start:end], c.logprobs[start:end],
                                                 self.req.logprobs, self.token_text,
                                                 prog.text_offset)
                        if lp.tokens:
                            prog.text_offset = lp.text_offset[-1] + len(lp.tokens[-1])
                    done = prog.finished
                    choice = p.CompletionStreamChoice(i * self.n + c.index, text, lp,
                                                      c.finish_reason if done else None,
                                                      c.stop_reason if done else None)
                    if self.req.return_token_ids:  # (the prompt's with a choice's first)
                        choice = p.CompletionStreamChoiceIds(
                            *msgspec.structs.astuple(choice),
                            out.prompt_token_ids if start == 0 else None,
                            list(c.token_ids[start:end]))
                    usage = self.usage([f for f in finals if f]) if continuous else None
                    yield event(p.CompletionStreamResponse(
                        self.request_id, "text_completion", self.created, self.model_name,
                        [choice], usage))
            if self.include_usage:
                yield event(p.CompletionStreamResponse(
                    self.request_id, "text_completion", self.created, self.model_name, [],
                    self.usage(finals)))
        except Exception as exc:
            yield error_event(exc, self.engine_id)
        yield DONE

    # --- chat ----------------------------------------------------------------------------------

    def chat_response(self, finals: list[RequestOutput]) -> p.ChatCompletionResponse:
        final = finals[0]
        choices = []
        for c in final.outputs:
            lp = self._chat_logprobs(c, 0, len(c.token_ids))
            text, think = c.text, None
            if self.reasoning is not None:
                think, text = split_reasoning(self._think_stream(), text)
                think = think if self.req.include_reasoning else None
            content, calls = text, []
            if self.tools is not None:
                content, calls = collect(self.tools.new_stream(), text)
            if (calls and not content.strip()) or (self.reasoning is not None and not content):
                content = None
            message = p.ChatResponseMessage(self.role, content, calls, think, think)
            choices.append(p.ChatChoice(c.index, message, lp,
                                        _finish_reason(c.finish_reason, bool(calls)),
                                        c.stop_reason,
                                        list(c.token_ids) if self.req.return_token_ids else None))
        return p.ChatCompletionResponse(
            self.request_id, "chat.completion", self.created, self.model_name, choices,
            self.usage(finals), prompt_logprobs(final.prompt_logprobs),
            final.prompt_token_ids if self.req.return_token_ids else None)

    def _chat_logprobs(self, c, start: int, end: int) -> p.ChatLogprobs | None:
        num_top = self.req.num_logprobs
        if num_top is None or c.logprobs is None:
            return None
        return chat_logprobs(c.token_ids[start:end], c.logprobs[start:end], num_top,
                             self.token_text)

    def _think_stream(self):
        if self.tools is not None and self.tools.reads_harmony:  # (the reasoning is harmony's)
            return self.reasoning.text_stream(self.prompt_token_ids[0], calls=True)
        return self.reasoning.text_stream(self.prompt_token_ids[0])

    def _chunk(self, choices: list, usage=None, prompt_token_ids=None) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(self.request_id, "chat.completion.chunk", self.created,
                                     self.model_name, choices, usage, prompt_token_ids)

    async def chat_events(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self.chat_chunks():
                yield event(chunk)
        except Exception as exc:
            yield error_event(exc, self.engine_id)
        yield DONE

    async def chat_chunks(self) -> AsyncIterator[p.ChatCompletionChunk]:
        """The stream's chunks: the role first, then each choice's deltas (its think, its
        content, its calls), the usage last when asked."""
        progress = [_Progress() for _ in range(self.n)]
        calls = [self.tools.new_stream() for _ in range(self.n)] if self.tools else None
        thinks = [self._think_stream() for _ in range(self.n)] if self.reasoning else None
        made_calls = [False] * self.n
        logprobs_from = [0] * self.n  # the first token whose logprobs are not sent yet
        final = None
        continuous = self.req.continuous_usage
        # vLLM's return_token_ids, unless include_reasoning hides the think's tokens
        with_ids = self.req.return_token_ids and (self.req.include_reasoning or
                                                  not self.reasoning)
        async for _, out in self.outputs():
            usage = self.usage([out]) if continuous else None
            if final is None:  # the role comes first, with the first output (as vLLM)
                for index in range(self.n):
                    yield self._chunk([p.ChatChunkChoice(
                        index, p.DeltaMessage(role=self.role, content=""))], usage,
                        out.prompt_token_ids if with_ids else None)
            final = out
            for c in out.outputs:
                prog = progress[c.index]
                step = prog.advance(c, self.stream_interval)
                if step is None:
                    continue
                text, _, end = step
                done = prog.finished
                think = None
                if thinks is not None:  # the think first: tools read only the content
                    think, text = thinks[c.index].feed(text)
                    if done:
                        more_think, more_text = thinks[c.index].finish()
                        think, text = think + more_think, text + more_text
                    think = (think or None) if self.req.include_reasoning else None
                delta = p.DeltaMessage(content=text)
                if calls is not None:
                    content, deltas = calls[c.index].feed(text)
                    if done:
                        more, last = calls[c.index].finish()
                        content, deltas = content + more, deltas + last
                    if not (content or deltas or think or done):
                        continue  # held back: a call may be starting
                    made_calls[c.index] |= bool(deltas)
                    delta = p.DeltaMessage(content=content or None, reasoning_content=think,
                                           reasoning=think, tool_calls=deltas or None)
                elif thinks is not None:
                    if not (text or think or done):
                        continue  # held back: a tag may be starting
                    delta = p.DeltaMessage(content=text or None, reasoning_content=think,
                                           reasoning=think)
                start, logprobs_from[c.index] = logprobs_from[c.index], end
                finish = _finish_reason(c.finish_reason, made_calls[c.index])
                choice = p.ChatChunkChoice(c.index, delta, self._chat_logprobs(c, start, end),
                                           finish if done else None,
                                           c.stop_reason if done else None)
                if with_ids:  # (tokens held back with their text come with it)
                    choice = p.ChatChunkChoiceIds(*msgspec.structs.astuple(choice),
                                                  list(c.token_ids[start:end]))
                yield self._chunk([choice], usage)
        self.final = final
        if self.include_usage:
            yield self._chunk([], self.usage([final]))


def _finish_reason(reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and reason == "stop" else reason


def _checked(out: RequestOutput) -> RequestOutput:
    if out.error:
        # a field the engine refused (a grammar it could not compile): the client's, not ours
        if out.error_field is not None:
            raise p.ApiError(400, out.error, out.error_field)
        raise p.ApiError(500, f"the engine failed this request: {out.error}")
    return out


async def unless_disconnected(request: Request, work: asyncio.Future) -> bool:
    """Wait for ``work``; False (and ``work`` cancelled) if the client hangs up first."""
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not work.done():
            work.cancel()
    return work.done() and not work.cancelled()


async def wait_for_disconnect(request: Request) -> None:
    # the body has been read: the next message on the channel is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass
