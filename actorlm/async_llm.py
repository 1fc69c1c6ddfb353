"""AsyncLLM: the asyncio facade over the actor engine (what the HTTP server talks to).

The engine's actors run on their own threads; a request's ``RequestOutput``s reach the event
loop through a sink whose ``put()`` hands each one to an ``asyncio.Queue`` with
``loop.call_soon_threadsafe`` — the awaiting coroutine sleeps until an output arrives, there is
no polling. The engine is always asked to stream (one cumulative output per step), so time to
first token and inter-token latency are known for every request, streamed to its client or not.

Submission (tokenizing, the chat template, the frontend's blocking ``ask``) runs on one
dedicated thread, never on the event loop: the frontend answers an ask only after the step
outputs already in its mailbox, which under load takes milliseconds that would stall every
stream on the loop. One thread is enough — the frontend handles one message at a time anyway —
and it keeps the tokenizer to one caller and the waiting-queue count (``max_num_waiting``)
exact.

A consumer that stops reading (client disconnect: ``CancelledError`` or ``GeneratorExit``)
aborts its request through the frontend; the scheduler finishes it as ``abort`` and its KV
blocks are freed.

A pooling model's request (``embed``) takes the same way in and out: its stream carries one
final ``EmbeddingRequestOutput`` instead of cumulative text.

The engine's supervisor tells this facade the moment an engine actor dies: every live request
then fails with ``EngineDeadError``, on whichever thread the death is reported (``_live`` is
guarded by a lock for that reason). Like ``LLM``, it needs no ``shutdown()``: a finalizer
stops the engine when the object is collected or the process ends.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator, Callable

import msgspec
import pykka

from actorlm.actors.supervisor import EngineDeadError, EngineShutdownError
from actorlm.admission import EngineOverloadedError, check_waiting_room
from actorlm.beam_search import BeamSearch, BeamSearchParams, BeamSearchStream
from actorlm.actors.system import EngineSystem
from actorlm.config import EngineConfig
from actorlm.engine_core import start_engine
from actorlm.engine_metrics import with_kv_usage
from actorlm.llm import PromptType, prompt_input, prompt_salt, salted
from actorlm.lora_request import LoRARequest
from actorlm.messages import AbortRequests, SubmitRequest
from actorlm.outputs import (ClassificationRequestOutput, DeltaOutputs, EmbeddingRequestOutput,
                             PoolingRequestOutput, RequestOutput)
from actorlm.pooling import NOTHING_SAMPLED, PoolingParams
from actorlm.request_timing import RequestTiming
from actorlm.sampling_params import RequestOutputKind, SamplingParams
from actorlm.trace import TraceRecorder

log = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "EngineShutdownError", "EngineOverloadedError",
           "RequestStream"]


class _LoopMailbox:
    """Outputs on their way from the frontend's thread to one event loop's queues. Waking a
    loop costs a write to its self-pipe, which costs more than the rest of a token's way
    through the frontend; so the loop is woken once for everything that arrives before it
    runs: a step's outputs for every stream, one wake-up."""

    _of_loop: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._woken = False  # a drain is scheduled and has not yet run

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> _LoopMailbox:
        """The loop's one mailbox (from the loop's own thread)."""
        mailbox = cls._of_loop.get(loop)
        if mailbox is None:
            mailbox = cls._of_loop[loop] = cls(loop)
        return mailbox

    def put(self, queue: asyncio.Queue, item) -> None:
        # runs on the frontend's thread; it must never raise there
        with self._lock:
            self._items.append((queue, item))
            if self._woken:
                return
            self._woken = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, collections.deque()
            self._woken = False
        for queue, item in items:
            queue.put_nowait(item)


class _AsyncSink:
    """The frontend's sink for one request: hands each output to its queue on the loop."""

    __slots__ = ("_mailbox", "_queue")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self._mailbox, self._queue = _LoopMailbox.of(loop), queue

    def put(self, item) -> None:
        self._mailbox.put(self._queue, item)


class RequestStream:
    """The outputs of one submitted request, as an async iterator; ``abort()`` cancels it."""

    def __init__(self, engine: AsyncLLM, request_id: str, prompt_token_ids: list[int],
                 sink: _AsyncSink, queue: asyncio.Queue, arrival: float,
                 kind: RequestOutputKind = RequestOutputKind.CUMULATIVE):
        self.engine, self.request_id = engine, request_id
        self.prompt_token_ids = prompt_token_ids
        self.finished = False
        self._sink, self._queue = sink, queue
        self._timing = RequestTiming(engine.stats_listener, arrival)
        self._kind = kind  # (the engine's outputs are cumulative: cut or held back here)
        self._delta = DeltaOutputs() if kind == RequestOutputKind.DELTA else None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput | EmbeddingRequestOutput:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self._close("error")
                raise item
            self._record(item)
            if isinstance(item, PoolingRequestOutput) or item.finished or \
                    self._kind != RequestOutputKind.FINAL_ONLY:
                return self._delta(item) if self._delta is not None else item
        raise StopAsyncIteration

    def abort(self) -> None:
        """Abort the request unless it has finished (idempotent; safe from the loop)."""
        if not self.finished:
            self._close("abort")
            self.engine.abort(self.request_id)

    def fail(self, error: BaseException) -> None:
        """Wake the reader with ``error`` (the engine died or is shutting down)."""
        self._sink.put(error)

    def _close(self, reason: str | None) -> None:
        """Done: by a finished output whose timing tells why (``reason`` None), or for
        ``reason``."""
        self.finished = True
        self.engine._forget(self.request_id)
        if reason is not None:
            self._timing.cut_short(reason)

    def _record(self, output: RequestOutput | EmbeddingRequestOutput) -> None:
        if isinstance(output, PoolingRequestOutput):
            # its one output, and no token generated: no first-token or inter-token latency
            self._close("error" if output.error else "stop")
            return
        self.engine.num_generation_tokens += self._timing.on_output(output)
        if output.finished:
            self._close(None)


class AsyncLLM:
    """``AsyncLLM(model=None, *, max_num_waiting=None, **engine_flags)``.

    Engine flags are the same as ``LLM``'s. ``max_num_waiting`` refuses new requests with
    ``EngineOverloadedError`` while that many already wait for a seat (``max_num_seqs``).
    Construction loads the model and blocks; build it off the event loop. Setting
    ``cancel_load`` (a ``threading.Event``) from another thread while an engine core in a
    process of its own loads stops it there (``LoadCancelled``).
    """

    def __init__(self, model: str | None = None, *, max_num_waiting: int | None = None,
                 trace_file: str | None = None, trace_capacity: int = 100_000,
                 cancel_load: threading.Event | None = None, **engine_flags):
        if max_num_waiting is not None and max_num_waiting < 1:
            raise ValueError(f"--max-num-waiting must be at least 1, got {max_num_waiting}")
        # always recording (a bounded ring): the server shows it live at /trace
        self.trace = TraceRecorder(capacity=trace_capacity, path=trace_file)
        self.engine = start_engine(EngineConfig.from_flags(model, **engine_flags),
                                   trace=self.trace, cancel_load=cancel_load)
        self.config = self.engine.config
        self.tokenizer = self.engine.tokenizer
        self.model_path = self.engine.model_path
        self.sampling_defaults = self.engine.sampling_defaults  # generation_config's
        self.reasoning = self.engine.reasoning  # the reasoning parser's tags, or None
        self.max_model_len: int = self.config.max_model_len
        # the most logprobs a request may ask for at a position (-1: the whole vocabulary)
        self.max_logprobs: int = self.config.max_logprobs if self.config.max_logprobs != -1 \
            else self.vocab_size
        self.max_num_waiting = max_num_waiting
        self.stats_listener = None  # metrics: observe_first_token, observe_inter_token, …
        self.num_generation_tokens = 0  # since start, for throughput logs
        self._submitter = ThreadPoolExecutor(1, thread_name_prefix="actorlm-submit")
        # now, not in the first request's TTFT: the thread's tokenizer copy, the chat template
        self._submitter.submit(_warm_submit_thread, self.engine).result()
        self._live: dict[str, RequestStream] = {}
        self._live_lock = threading.Lock()
        self._ids = itertools.count()
        self._stopped = False
        # weakly: the supervisor (held by the engine, held by the finalizer) must not keep
        # this object alive
        on_death = weakref.WeakMethod(self._on_engine_death)
        self.engine.supervisor.watch(lambda error: (m := on_death()) and m(error))
        self._finalizer = weakref.finalize(self, _stop, self.engine, self.trace, self._submitter)

    # --- requests -------------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: PromptType,
                          sampling_params: SamplingParams | None = None,
                          lora_request: LoRARequest | None = None,
                          priority: int = 0,
                          pooling_params: PoolingParams | None = None) -> RequestStream:
        """Validate and start one request (with a LoRA adapter: needs ``enable_lora``; a
        ``priority`` other than 0, smaller served first: ``scheduling_policy="priority"``; with
        ``pooling_params``, an embedding request: needs a pooling model); raises ValueError for
        bad input, EngineOverloadedError when the waiting queue is full, EngineDeadError after a
        fault."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        sink = _AsyncSink(loop, queue)
        arrival = time.monotonic()
        params = sampling_params or self.get_default_sampling_params()
        submit = loop.run_in_executor(self._submitter, self._submit, request_id,
                                      prompt_input(prompt), params, sink, lora_request,
                                      prompt_salt(prompt), priority, pooling_params)
        try:
            # shielded: a cancelled caller must not leave a submitted request running unseen
            prompt_token_ids = await asyncio.shield(submit)
        except asyncio.CancelledError:
            submit.add_done_callback(
                lambda f: f.cancelled() or f.exception() is not None or self.abort(request_id))
            raise
        stream = RequestStream(self, request_id, prompt_token_ids, sink, queue, arrival,
                               params.output_kind)
        with self._live_lock:
            self._live[request_id] = stream
        if self.stats_listener is not None:
            self.stats_listener.on_request_added(len(prompt_token_ids))
        if self._stopped or self.engine.supervisor.error is not None:  # while we submitted
            stream.fail(self._dead_error())
        return stream

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, lora_request: LoRARequest | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield a ``RequestOutput`` after every step, cumulative (what each step added with
        ``output_kind`` DELTA; the last one alone with FINAL_ONLY); the last has ``finished``.
        Leaving the loop early (or being cancelled) aborts the request."""
        request_id = request_id if request_id is not None else f"async-{next(self._ids)}"
        stream = await self.add_request(request_id, prompt, sampling_params, lora_request,
                                        priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def add_beam_search(self, request_id: str, prompt: PromptType,
                              params: BeamSearchParams, lora_request: LoRARequest | None = None,
                              priority: int = 0) -> BeamSearchStream:
        """Start a beam search (``actorlm.beam_search``): its stream's one output holds the
        ``beam_width`` best continuations as its ``outputs``, best first. The prompt is
        checked here, as ``add_request`` checks it."""
        step = params.step_params(self.config.max_logprobs)
        first = await self.add_request(f"{request_id}-0", prompt, step, lora_request, priority)
        salt = prompt_salt(prompt)
        task = asyncio.ensure_future(self._beam_search(
            request_id, first, params, lambda rid, tokens: self._one_token(
                rid, salted(tokens, salt), step, lora_request, priority)))
        return BeamSearchStream(request_id, first.prompt_token_ids, task)

    async def _beam_search(self, request_id: str, first: RequestStream,
                           params: BeamSearchParams, one_token) -> RequestOutput:
        search = BeamSearch(first.prompt_token_ids, params, self.engine.eos_token_ids,
                            self.max_model_len)
        outs, step = [await self._final(first)], 0
        while (failed := next((o for o in outs if o.error is not None), None)) is None:
            search.advance(outs)
            if search.done:
                return await self.run_blocking(search.request_output, request_id, self.decode)
            step += 1
            steps = [asyncio.ensure_future(one_token(f"{request_id}-{step}-{i}", beam.tokens))
                     for i, beam in enumerate(search.beams)]
            try:
                outs = await asyncio.gather(*steps)
            finally:  # (a failed or cancelled step leaves none of the others running)
                for task in steps:
                    task.cancel()
        return dataclasses.replace(failed, request_id=request_id)

    async def _one_token(self, request_id: str, prompt, params: SamplingParams,
                         lora_request: LoRARequest | None, priority: int) -> RequestOutput:
        return await self._final(await self.add_request(request_id, prompt, params,
                                                        lora_request, priority))

    @staticmethod
    async def _final(stream: RequestStream) -> RequestOutput:
        """A request's last output (leaving early aborts it)."""
        try:
            async for output in stream:
                final = output
        finally:
            stream.abort()  # (a no-op once finished)
        return final

    async def embed(self, prompt: PromptType, pooling_params: PoolingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> EmbeddingRequestOutput:
        """The prompt's embedding from a pooling model (``error`` set, and the embedding empty,
        if the engine failed it). Being cancelled aborts the request."""
        return await self._pool(prompt, pooling_params, "embed", request_id, priority)

    async def classify(self, prompt: PromptType, pooling_params: PoolingParams | None = None,
                       request_id: str | None = None,
                       priority: int = 0) -> ClassificationRequestOutput:
        """The prompt's class probabilities from a classifier, as ``embed`` does."""
        return await self._pool(prompt, pooling_params, "classify", request_id, priority)

    async def _pool(self, prompt, pooling_params: PoolingParams | None, task: str,
                    request_id: str | None, priority: int):
        request_id = request_id if request_id is not None else f"pool-{next(self._ids)}"
        params = msgspec.structs.replace(pooling_params or PoolingParams(), task=task)
        return await self._final(await self.add_request(
            request_id, prompt, NOTHING_SAMPLED, priority=priority, pooling_params=params))

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's sampling defaults (``generation_config``) on top of SamplingParams'."""
        return self.sampling_defaults.sampling_params()

    def abort(self, request_id: str) -> None:
        """Ask the engine to abort a request (non-blocking; unknown ids are ignored)."""
        self._forget(request_id)
        try:
            self.engine.frontend.tell(AbortRequests([request_id]))
        except pykka.ActorDeadError:
            pass

    def _submit(self, request_id: str, prompt, params: SamplingParams, sink,
                lora_request: LoRARequest | None = None,
                cache_salt: str | None = None, priority: int = 0,
                pooling_params: PoolingParams | None = None) -> list[int]:
        # on the submit thread: blocking asks are fine here
        try:
            if self.max_num_waiting is not None:
                check_waiting_room(self.engine.scheduler_stats(),
                                   self.config.max_num_seqs * self.config.data_parallel_size,
                                   self.max_num_waiting)
            return self.engine.frontend.ask(SubmitRequest(request_id, prompt, params, sink, True,
                                                          lora_request, cache_salt, priority,
                                                          pooling_params))
        except pykka.ActorDeadError:
            raise self.engine.supervisor.dead_error() from None

    # --- tokenizer ------------------------------------------------------------------------------

    async def run_blocking(self, fn: Callable, *args):
        """Run ``fn(*args)`` on the submit thread (the tokenizer's one caller on this side)."""
        return await asyncio.get_running_loop().run_in_executor(self._submitter, fn, *args)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **template_kwargs) -> list[int]:
        """The conversation rendered through the model's chat template, as token ids."""
        return self.engine.apply_chat_template(messages, add_generation_prompt, **template_kwargs)

    @property
    def vocab_size(self) -> int:
        return self.engine.hf_config.vocab_size

    # --- health and stats -------------------------------------------------------------------------

    @property
    def is_ready(self) -> bool:
        return self.check_health() is None

    def check_health(self) -> str | None:
        """None while the engine serves; else why not. Cheap (no asks)."""
        if self._stopped:
            return "the engine is shutting down"
        error = self.engine.supervisor.error
        return None if error is None else str(error)

    def _on_engine_death(self, error: EngineDeadError) -> None:
        # on the dying actor's thread: every live request fails at once
        if not self._stopped:
            self._fail_live(error)

    def _fail_live(self, error: BaseException) -> None:
        with self._live_lock:
            streams = list(self._live.values())
        if streams:
            log.log(logging.INFO if isinstance(error, EngineShutdownError) else logging.ERROR,
                    "%s; failing %d live request(s)", error, len(streams))
        for stream in streams:
            stream.fail(error)

    def _forget(self, request_id: str) -> None:
        with self._live_lock:
            self._live.pop(request_id, None)

    def _check_alive(self) -> None:
        if self._stopped or self.engine.supervisor.error is not None:
            raise self._dead_error()

    def _dead_error(self) -> EngineDeadError:
        if self._stopped:
            return EngineShutdownError("the engine is shutting down")
        return self.engine.supervisor.dead_error()

    def stats(self) -> dict:
        """Scheduler and KV pool counters (blocking asks: call off the event loop)."""
        return {**with_kv_usage(self.engine.stats()),
                "num_generation_tokens": self.num_generation_tokens}

    def replica_stats(self) -> list[dict]:
        """The same per data-parallel replica (blocking asks)."""
        return [with_kv_usage(stats) for stats in self.engine.replica_stats()]

    async def get_stats(self) -> dict:
        return await asyncio.to_thread(self.stats)

    async def reset_prefix_cache(self) -> bool:
        self._check_alive()
        return await asyncio.to_thread(self.engine.reset_prefix_cache)

    # --- lifecycle --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Fail live requests, then stop the actors (blocking; idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        self._fail_live(EngineShutdownError("the engine is shutting down"))
        self._finalizer()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.shutdown)


def _warm_submit_thread(engine: EngineSystem) -> None:
    """Make the submit thread's tokenizer copy (``PerThreadTokenizer``) and compile the chat
    template (jinja: 10-30 ms, which transformers then caches) by rendering a short
    conversation through it."""
    getattr(engine.tokenizer, "for_this_thread", None)
    if getattr(engine.tokenizer, "chat_template", None) is None:
        return
    try:
        engine.apply_chat_template([{"role": "user", "content": "Hello"}])
    except Exception:  # noqa: BLE001 — a template may refuse this conversation; compiled anyway
        log.debug("the chat template refused the warm-up conversation", exc_info=True)


def _stop(engine: EngineSystem, trace: TraceRecorder, submitter: ThreadPoolExecutor) -> None:
    submitter.shutdown(wait=False, cancel_futures=True)
    engine.stop()
    trace.close()

