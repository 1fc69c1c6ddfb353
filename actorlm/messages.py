"""Every message that crosses an actor boundary.

Messages are immutable msgspec Structs so that the same types travel in-process (as objects)
and to worker processes (msgpack-encoded). Per-step messages are ``array_like`` (encoded as
arrays, no field names on the wire) and ``gc=False`` (they hold only scalars, strings and lists
of those, so they can never take part in a reference cycle).

Commands are imperative (``AddRequest``), events are past tense (``StepCompleted``).
This module imports nothing from pykka: it is the contract, not the machinery.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actorlm.sampling_params import SamplingParams


class _Message(msgspec.Struct, frozen=True):
    pass


class _StepMessage(msgspec.Struct, frozen=True, array_like=True, gc=False):
    pass


# --- API edge -> frontend -------------------------------------------------------------------


class SubmitRequest(_Message):
    """Ask the frontend to validate, tokenize and start one request.

    ``prompt`` is text or token ids. ``sink`` receives ``RequestOutput``s (in-process only):
    any object with ``put(output)`` — a ``queue.Queue`` or an asyncio bridge.
    """

    request_id: str
    prompt: str | list[int]
    sampling_params: SamplingParams
    sink: Any = None
    stream: bool = False


# --- frontend <-> scheduler ------------------------------------------------------------------


class AddRequest(_Message):
    """A validated, tokenized request entering the engine."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    arrival_time: float


class AbortRequests(_Message):
    request_ids: list[str]


class FailRequests(_Message):
    """The engine could not serve these requests (a fault it caused); finish them as errors."""

    request_ids: list[str]
    error: str


class RequestDelta(_StepMessage):
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0


class EngineOutputs(_StepMessage):
    """Everything the frontend needs from one step: one message, a delta per request."""

    step_id: int
    deltas: list[RequestDelta]


# --- scheduler <-> allocator -----------------------------------------------------------------


class AllocateSlots(_StepMessage):
    """One step's block traffic: free what finished or was preempted, then grant blocks.

    The scheduler plans against the free count the allocator last reported, so the grant
    never fails; the allocator still checks and refuses the whole step if it would.
    """

    step_id: int
    free_request_ids: list[str]
    request_ids: list[str]
    num_new_blocks: list[int]


class SlotsGranted(_StepMessage):
    step_id: int
    request_ids: list[str]
    new_block_ids: list[list[int]]
    num_free_blocks: int
    num_total_blocks: int


class SlotsRefused(_StepMessage):
    step_id: int
    reason: str
    num_free_blocks: int


# --- scheduler -> executor -> workers --------------------------------------------------------


class NewRequestData(_StepMessage):
    """A request the workers have not seen (or forgot after a preemption): sent in full."""

    request_id: str
    token_ids: list[int]  # prompt followed by any output already produced (recompute)
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int


class CachedRequestData(_StepMessage):
    """A request the workers already hold: only what changed since the last step."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


class ScheduleStep(_StepMessage):
    """One engine step. ``num_scheduled_tokens`` is keyed by position in
    ``new_requests + cached_requests``; ``finished_request_ids`` are dropped by the workers
    before the step runs (finished, aborted or preempted since the previous step)."""

    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: list[int]
    finished_request_ids: list[str]


class StepResult(_StepMessage):
    """Sampled tokens of one step. ``sampled_token_ids[i]`` belongs to ``request_ids[i]``;
    requests still mid-prefill are absent. ``error`` is set when the step failed as a whole."""

    step_id: int
    request_ids: list[str]
    sampled_token_ids: list[int]
    error: str | None = None
    failed_request_ids: list[str] = []


class WorkerResult(_StepMessage):
    """One worker's answer to a step; the executor gathers one per rank."""

    rank: int
    result: StepResult


# --- introspection (API edge and tests) ------------------------------------------------------


class GetStats(_Message):
    pass


class SchedulerStats(_Message):
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_steps: int
    num_free_blocks: int
    num_total_blocks: int
    num_finished: int


class KVStats(_Message):
    num_free_blocks: int
    num_total_blocks: int
    num_requests_holding_blocks: int


class Connect(_Message):
    """Setup only, in-process: hands the scheduler its peers after every actor has started."""

    frontend: Any
    allocator: Any
    executor: Any


STEP_MESSAGE_TYPES = (AllocateSlots, SlotsGranted, SlotsRefused, ScheduleStep, StepResult,
                      WorkerResult, EngineOutputs)
