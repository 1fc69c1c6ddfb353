"""Every message that crosses an actor boundary.

Messages are immutable msgspec Structs so that the same types travel in-process (as objects)
and to worker processes (msgpack-encoded). Per-step messages are ``array_like`` (encoded as
arrays, no field names on the wire) and ``gc=False`` (they hold scalars, strings, lists and
Structs of those, built fresh for each message and never pointing back at their holder, so they
can never take part in a reference cycle).

Commands are imperative (``AddRequest``), events are past tense (``SlotsGranted``).
This module imports nothing from pykka: it is the contract, not the machinery.
"""

from __future__ import annotations

from typing import Any

import msgspec

from actorlm.lora_request import LoRARequest
from actorlm.pooling import PoolingParams
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
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model
    cache_salt: str | None = None  # its prefix-cache tenant: it shares cached blocks only with
    # requests of the same salt (vLLM's ``cache_salt``)
    priority: int = 0  # under --scheduling-policy priority: smaller is served first
    # an embedding request's (a pooling model's): its prompt is pooled, nothing is sampled
    pooling_params: PoolingParams | None = None


# --- frontend <-> scheduler ------------------------------------------------------------------


class AddRequest(_Message):
    """A validated, tokenized request entering the engine. With ``sampling_params.n > 1`` the
    scheduler runs ``n`` children named ``child_request_id(request_id, i)``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int
    arrival_time: float
    bad_words_token_ids: list[list[int]] = []
    # a request resumed in a restarted engine core: the tokens it had streamed, recomputed
    # as after a preemption before it continues (n = 1 here: each child resumes alone)
    output_token_ids: list[int] = []
    lora_request: LoRARequest | None = None  # (its directory checked by the frontend)
    # resumed after more than one engine-core death: it runs alone for a step (on probation)
    # before it rejoins the batch, so a death in that step is known to be its doing
    suspect: bool = False
    cache_salt: str | None = None  # (SubmitRequest's)
    priority: int = 0  # (SubmitRequest's)
    pooling_params: PoolingParams | None = None  # (SubmitRequest's)


class AbortRequests(_Message):
    request_ids: list[str]


class StopRequests(_Message):
    """The frontend found a stop string: finish these with reason "stop" and free their blocks."""

    request_ids: list[str]
    stop_reasons: list[str]


class PositionLogprobs(_StepMessage):
    """Log-probabilities at one position: ``token_ids[0]`` is the token actually there (sampled
    or given), followed by the top-k; ``rank`` is the first token's 1-based rank."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class RequestDelta(_StepMessage):
    """What one request produced in one step."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    new_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs] | None = None  # positions computed in this step
    # with ``error``: the request field the client got wrong (a grammar that does not compile,
    # say), which the API answers with a 400 naming it; None: the engine failed
    error_field: str | None = None
    pooled: bytes | None = None  # an embedding request's vector (float32), as it finishes


class EngineOutputs(_StepMessage):
    """Everything the frontend needs from one step: one message, a delta per request.

    A request on probation runs alone in a step (``Scheduler``: after worker faults, or as an
    engine-core death's suspect, ``AddRequest.suspect``): ``on_trial`` names it as that step
    starts, ``trial_over`` once the step has ended, so that a frontend whose engine core dies
    in between knows that request was the one running."""

    step_id: int
    deltas: list[RequestDelta]
    on_trial: list[str] = []
    trial_over: list[str] = []


# --- scheduler <-> allocator -----------------------------------------------------------------


class ComputedBlocks(_StepMessage):
    """Blocks of ``request_id`` whose KV the last step completed: table positions
    ``first_block, first_block + 1, …`` hold the blocks with these content hashes."""

    request_id: str
    first_block: int
    block_hashes: list[int]


class Candidate(_StepMessage):
    """A waiting request the scheduler would admit. ``block_hashes`` are its full blocks that
    a prefix-cache hit may cover (never the block of its last token, which must be computed);
    it may compute up to ``max_new_tokens`` of its ``num_tokens`` tokens in this step."""

    request_id: str
    num_tokens: int
    max_new_tokens: int
    block_hashes: list[int] = []


class AllocateSlots(_StepMessage):
    """One step's block traffic, proposed by the scheduler and decided by the allocator, in
    this order: blocks completed by the last step enter the prefix cache (in every KV-cache
    group); finished requests release theirs; with ``reset_prefix_cache`` every cached prefix
    is forgotten; the sliding-window groups of each running request let go of the blocks its
    window has left (it has ``num_computed_tokens[i]`` computed before this step; empty: none
    known, nothing is let go); each running request (``request_ids``, in priority order)
    grows to hold ``num_tokens[i]`` tokens, and when blocks run short the last ones in that
    order are preempted (their blocks released) to make room; then, only if nobody was
    preempted, the candidates are admitted in order while blocks last, each starting at its
    prefix-cache hit.

    The allocator decides with its own counts, so the grant never fails: it may only preempt
    from the tail and admit fewer candidates than proposed.
    """

    step_id: int
    free_request_ids: list[str]
    request_ids: list[str]
    num_tokens: list[int]
    candidates: list[Candidate] = []
    computed_blocks: list[ComputedBlocks] = []
    reset_prefix_cache: bool = False
    num_computed_tokens: list[int] = []


class Admitted(_StepMessage):
    """A candidate that got its blocks: ``block_ids[g]`` is its whole table in KV-cache group
    ``g`` (block 0 where a sliding-window group needs no block); it has ``num_cached_tokens``
    computed already (the hit) and computes ``num_new_tokens`` now."""

    request_id: str
    block_ids: list[list[int]]
    num_cached_tokens: int
    num_new_tokens: int


class SlotsGranted(_StepMessage):
    """``new_block_ids[i][g]`` extends the table in KV-cache group ``g`` of the step's running
    request ``i`` (``new_block_ids[i]`` empty: no new block in any group); the running
    requests past ``len(new_block_ids)`` were preempted (``preempted_ids``, newest first).
    ``num_used_blocks[g]``: blocks group ``g`` holds after the grant."""

    step_id: int
    new_block_ids: list[list[list[int]]]
    preempted_ids: list[str]
    admitted: list[Admitted]
    num_free_blocks: int
    num_cached_blocks: int
    num_used_blocks: list[int] = []


# --- scheduler -> executor -> workers --------------------------------------------------------


class NewRequestData(_StepMessage):
    """A request the workers have not seen (or forgot after a preemption): sent in full.
    ``block_ids[g]`` is its block table in KV-cache group ``g``."""

    request_id: str
    token_ids: list[int]  # prompt followed by any output already produced (recompute)
    num_prompt_tokens: int
    block_ids: list[list[int]]
    num_computed_tokens: int
    sampling_params: SamplingParams
    seed: int
    bad_words_token_ids: list[list[int]] = []
    lora_request: LoRARequest | None = None
    pooling_params: PoolingParams | None = None  # an embedding request's: pooled, not sampled


class CachedRequestData(_StepMessage):
    """A request the workers already hold: only what changed since the last step.
    ``new_block_ids[g]`` extends its table in KV-cache group ``g`` (empty: nothing new in any
    group, a decode step's usual case). Entries a sliding-window group let go of are not
    sent: no query reads them."""

    request_id: str
    new_block_ids: list[list[int]]
    num_computed_tokens: int


class ScheduleStep(_StepMessage):
    """One engine step. ``num_scheduled_tokens`` is keyed by position in
    ``new_requests + cached_requests``; ``finished_request_ids`` are dropped by the workers
    before the step runs (finished, aborted or preempted since the previous step).

    ``structured_request_ids`` sample under a grammar: the workers run the forward, then wait
    for the step's ``GrammarBitmask`` (filled by the scheduler meanwhile) before sampling.

    ``last_token_ids[i]`` is the last token of ``cached_requests[i]``: the one sampled in its
    previous step, if that step sampled. Tensor-parallel ranks other than 0 do not sample, so
    this is how they learn it (with the drafts of that step it accepted, which they hold).

    ``spec_token_ids[i]`` (speculative decoding; empty: no request has any) are the draft
    tokens ``cached_requests[i]`` verifies: they follow its tokens in the step's input, and are
    counted in its ``num_scheduled_tokens``."""

    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: list[int]
    finished_request_ids: list[str]
    structured_request_ids: list[str] = []
    last_token_ids: list[int] = []
    spec_token_ids: list[list[int]] = []

    @property
    def request_ids(self) -> list[str]:
        """Every scheduled request, in ``num_scheduled_tokens`` order."""
        return [d.request_id for d in self.new_requests] + \
            [d.request_id for d in self.cached_requests]


class GrammarBitmask(_StepMessage):
    """The allowed next tokens of a step's ``structured_request_ids``, in that order: per
    request a row of little-endian int32 words, bit ``t`` set when token ``t`` is allowed."""

    step_id: int
    request_ids: list[str]
    bitmask: bytes


class PromptLogprobs(_StepMessage):
    """Logprobs of prompt tokens ``start, start + 1, …`` (the ones this step's logits predict)."""

    request_id: str
    start: int
    positions: list[PositionLogprobs]


class StepResult(_StepMessage):
    """Sampled tokens of one step. ``sampled_token_ids[i]`` belongs to ``request_ids[i]``;
    requests still mid-prefill are absent. ``logprobs`` is aligned with them (None where not
    asked). ``failed_request_ids`` failed alone in this step (the runner says why in ``error``);
    the step's other requests got their tokens.

    ``fault`` says the step did not happen: a worker raised or died and has been replaced, so
    the workers hold no request any more and everything the scheduler runs is recomputed.
    ``blame_request_ids`` are the requests the faulted step ran (empty when the worker died
    between steps): the scheduler counts the fault against them to find a poison request.

    ``timings`` are the runner's seconds in this step: [input preparation, forward, logits and
    sampling] (on a GPU the forward is only launched when its clock stops; sampling waits).
    ``rank_timings[r]`` are rank ``r``'s, filled by the executor (``timings`` are rank 0's).
    ``router_s`` and ``experts_s``: the forward's seconds in the routers and in the experts
    of its mixture-of-experts layers (``models.moe.MoeTimer``), rank 0's; None where not
    measured (a dense model, a GPU).

    Speculative decoding (empty lists when the step had no drafts and proposes none):
    ``accepted_token_ids[i]`` are the drafts of ``request_ids[i]`` the step accepted, which
    precede ``sampled_token_ids[i]`` (the bonus or recovered token) in its output, and
    ``accepted_logprobs[i]`` their logprobs where asked; ``spec_token_ids[i]`` are the drafts
    proposed for its next step.

    ``pooled[i]`` is the embedding (float32 bytes) of ``pooled_request_ids[i]``, a pooling
    model's request whose prompt this step completed."""

    step_id: int
    request_ids: list[str]
    sampled_token_ids: list[int]
    error: str | None = None
    failed_request_ids: list[str] = []
    logprobs: list[PositionLogprobs | None] = []
    prompt_logprobs: list[PromptLogprobs] = []
    fault: str | None = None
    blame_request_ids: list[str] = []
    timings: list[float] = []
    rank_timings: list[list[float]] = []
    router_s: float | None = None
    experts_s: float | None = None
    accepted_token_ids: list[list[int]] = []
    accepted_logprobs: list[list[PositionLogprobs]] = []
    spec_token_ids: list[list[int]] = []
    pooled_request_ids: list[str] = []
    pooled: list[bytes] = []


class WorkerResult(_StepMessage):
    """One worker's answer to a step; the executor gathers one per rank."""

    rank: int
    result: StepResult


class WorkerFailed(_Message):
    """A worker raised in a step or its thread is ending; ``generation`` tells the executor
    whether it is the worker it still relies on or one it has already replaced."""

    rank: int
    generation: int
    error: str


class GrammarCompiled(_Message):
    """In-process only: a request's grammar is compiled (``grammar``) or could not be
    (``error``); sent to the scheduler from the compiler's thread."""

    request_id: str
    grammar: Any = None
    error: str | None = None


class WorkerRestarted(_Message):
    """In-process only: a replacement worker group (``actorlm.executors``) has started, every
    rank loaded (or ``error`` says why it could not), on a thread of its own, off the
    executor's."""

    generation: int
    workers: Any = None
    error: str | None = None


# --- introspection (API edge and tests) ------------------------------------------------------


class GetStats(_Message):
    pass


class SchedulerStats(_Message):
    num_running: int
    num_waiting: int
    num_preemptions: int
    num_steps: int
    num_finished: int
    num_scheduled_tokens: int = 0  # every token computed so far, prefill and decode
    num_prefill_tokens: int = 0  # of those, at prompt (or recomputed) positions
    # speculative decoding (``core.spec_decoding.SpecDecodingCounts``), since start
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []
    # the adapters of the running and of the waiting requests, by name (``/metrics``'
    # vllm:lora_requests_info)
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    # how long the step in flight has run (0: none in flight): a worker stuck in a kernel
    # shows here while the scheduler itself still answers
    step_running_s: float = 0.0


class ExecutorStats(_Message):
    num_worker_restarts: int  # times the worker group was restarted after a fault
    worker_pids: list[int] = []  # the ranks' processes (mp, ray); empty for thread workers


class KVStats(_Message):
    num_free_blocks: int  # held by no request (cached ones included: they are evictable)
    num_total_blocks: int  # (with a sliding-window group, block 0 the placeholder is not one)
    num_requests_holding_blocks: int
    num_cached_blocks: int = 0  # free blocks whose KV is still a cached prefix
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache, since start
    prefix_cache_hits: int = 0  # of those, tokens found
    num_used_blocks: list[int] = []  # blocks held by requests, per KV-cache group


class ResumeRequests(_Message):
    """The engine core was restarted: the frontend replies ``Resumed`` with an ``AddRequest``
    for every child still running (its prompt and the tokens it has streamed), and finishes
    those already stopped or aborted, which the new core will never report. ``engine_ids``:
    only the requests among these (the restarted core's, under data parallelism)."""

    engine_ids: list[str] | None = None


class Resumed(_Message):
    requests: list[AddRequest]
    request_ids: list[str]  # the caller ids of the live requests, resumed or finished now


class ResetPrefixCache(_Message):
    """Forget every cached prefix (blocks in use stay with their requests); replies True."""


class Connect(_Message):
    """Setup only, in-process: hands the scheduler its peers after every actor has started."""

    frontend: Any
    allocator: Any
    executor: Any


def child_request_id(request_id: str, index: int) -> str:
    """The engine-side id of child ``index`` of an ``n > 1`` request (vLLM's naming)."""
    return f"{index}_{request_id}"


def engine_request_ids(request_id: str, n: int) -> list[str]:
    """The ids the engine runs for one request: itself, or its ``n`` children when n > 1."""
    return [request_id] if n == 1 else [child_request_id(request_id, i) for i in range(n)]


STEP_MESSAGE_TYPES = (AllocateSlots, SlotsGranted, ScheduleStep, GrammarBitmask, StepResult,
                      WorkerResult, EngineOutputs)
