"""TraceRecorder: every state transition, actor message and engine step, in a bounded ring buffer.

The recorder is fed from three places, all cheap enough to leave on in production:

- the request state machine: ``on_transition`` is a ``Machine`` listener (docs/architecture.md);
- the actor message path: ``wrap(ref, sender, receiver)`` returns a ref that records each
  message it carries (type, step, msgpack size) before passing it on;
- the scheduler actor's loop: ``before_plan`` / ``planned`` / ``granted`` / ``step_result``
  produce one ``StepSummary`` per planned step (with speculative decoding: the drafts each
  request verified, read off the granted plan, and how many the result accepted), and
  ``on_arrival`` / ``on_control`` record what reached the scheduler and at which step.

Records are frozen msgspec Structs (``actorlm.trace.records``) kept in a
``deque(maxlen=capacity)``, so memory stays flat on a long-running server. With ``path``,
every record is also appended to a JSON-lines file (written in batches and on ``flush``), which
therefore holds the whole run, not just the ring buffer's window.

Threads: transitions, steps, arrivals and the scheduler's own messages are recorded on the
scheduler's thread; other actors record the messages they send on their own threads. Appends
take no lock (deque and list appends are atomic); only file writes do.

Recording must never fail the actor it runs in: a message that cannot be encoded is recorded
with ``num_bytes`` -1 and delivered all the same.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Any, Iterable

import msgspec

from actorlm.core.block_pool import num_usable_blocks
from actorlm.fsm import RequestEvent, RequestState
from actorlm.messages import STEP_MESSAGE_TYPES, AbortRequests, AddRequest, StopRequests
from actorlm.trace.records import (Abort, Arrival, MessageSent, Record, StateChange,
                                   StepSummary, Stop, TraceConfig, encode_line, encode_lines,
                                   jsonl_lines)

DEFAULT_CAPACITY = 100_000
_WRITE_BATCH = 4096  # records buffered for the file before a write

_STATE_NAMES = {s: s.name.lower() for s in RequestState}
_EVENT_NAMES = {e: e.value for e in RequestEvent}
_FINISHED, _RUNNING = RequestState.FINISHED, RequestState.RUNNING
_STEP_TYPES = frozenset(STEP_MESSAGE_TYPES)
_TIMINGS = ("prepare_s", "forward_s", "sample_s")  # StepResult.timings, in order


def estimate_size(message) -> int:
    """A cheap stand-in for the msgpack size of a message that is not per-step (one per
    request, not per step: an exact encode is not worth its cost there)."""
    size = 16
    for name in getattr(message, "__struct_fields__", ()):
        value = getattr(message, name)
        if isinstance(value, (list, str)):
            size += 2 + (3 if isinstance(value, list) else 1) * len(value)
        else:
            size += 8
    return size


class TracedRef:
    """Stands in for an actor ref: records each message, then forwards it unchanged.

    One per (sender, receiver) pair, used from the sender's thread, so its encoder is never
    shared between threads.
    """

    __slots__ = ("_ref", "_recorder", "_sender", "_receiver", "_encoder")

    def __init__(self, ref, recorder: TraceRecorder, sender: str, receiver: str):
        self._ref, self._recorder = ref, recorder
        self._sender, self._receiver = sender, receiver
        self._encoder = msgspec.msgpack.Encoder()

    def tell(self, message) -> None:
        # the hot path of tracing (several messages per step): kept to a few operations
        recorder, cls = self._recorder, message.__class__
        if cls in _STEP_TYPES:
            step = message.step_id
            if step < 0:
                step = recorder.step
            try:
                num_bytes = len(self._encoder.encode(message))
            except (OverflowError, TypeError, ValueError):  # not encodable: record, deliver
                num_bytes = -1
        else:
            step, num_bytes = recorder.step, estimate_size(message)
        recorder._append(MessageSent(recorder._now(), step, cls.__name__, self._sender,
                                     self._receiver, num_bytes))
        self._ref.tell(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ref, name)

    def __repr__(self) -> str:
        return f"TracedRef({self._sender}->{self._receiver}, {self._ref!r})"


class _PendingStep:
    __slots__ = ("plan", "t_start", "num_running", "num_waiting", "granted", "drafts")

    def __init__(self, plan, t_start, num_running, num_waiting):
        self.plan, self.t_start = plan, t_start
        self.num_running, self.num_waiting = num_running, num_waiting
        self.granted = None  # the allocator's SlotsGranted
        self.drafts: list[list[int]] = []  # per plan request, the drafts it verifies


class TraceRecorder:
    """A bounded in-memory trace, optionally mirrored to a JSON-lines file at ``path``.

    ``capacity`` bounds the records kept in memory (the configuration record is kept apart
    and is always first in an export). ``clock`` is anything with ``monotonic()``.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, path=None, clock=time):
        if capacity <= 0:
            raise ValueError(f"trace capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.path = path
        self._now = clock.monotonic
        self._wall = getattr(clock, "time", time.time)
        self._records: deque[Record] = deque(maxlen=capacity)
        self._write_lock = threading.Lock()  # file writes only: appends need no lock
        # appends take a number each (next() on a count is atomic); so does every read of
        # num_recorded, which remembers how many it took
        self._seq = itertools.count()
        self._take = self._seq.__next__
        self._num_reads = 0
        self._read_lock = threading.Lock()
        self.config: TraceConfig | None = None
        self._num_usable_blocks = 0  # the pool's blocks, less the placeholder if it has one
        self.step = 0  # the step being planned, in flight or applied
        self.next_step_id = 0  # the next step the scheduler will plan
        self._scheduler = None
        self._requests: dict = {}
        self._pending: _PendingStep | None = None
        self._file = open(path, "wb") if path is not None else None
        self._unwritten: list[Record] = []
        self._forwarded: deque[Record] | None = None  # ``forward()``: records not yet taken

    # --- set-up -------------------------------------------------------------------------------

    def configure(self, config, eos_token_ids: Iterable[int] = (), model: str = "",
                  kv_cache_windows: Iterable[int | None] = (None,),
                  long_rope_from: int | None = None) -> None:
        """Record the engine configuration (an ``EngineConfig`` after ``resolve``), the
        window of each KV-cache group the block pool serves and a LongRoPE model's original
        context (``ModelParts.long_rope_from``)."""
        windows = list(kv_cache_windows)
        spec = getattr(config, "speculative_config", None)
        max_loras = config.max_loras if getattr(config, "enable_lora", False) else 0
        self._num_usable_blocks = num_usable_blocks(config.num_kv_blocks, windows)
        self.config = TraceConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
            block_size=config.block_size, num_kv_blocks=config.num_kv_blocks,
            enable_chunked_prefill=config.enable_chunked_prefill,
            eos_token_ids=sorted(eos_token_ids),
            enable_prefix_caching=config.enable_prefix_caching, model=model, t0=self._now(),
            wall_time=self._wall(), capacity=self.capacity,
            kv_cache_windows=[] if windows == [None] else windows,
            num_speculative_tokens=spec.num_speculative_tokens if spec is not None else 0,
            max_loras=max_loras,
            scheduling_policy=getattr(config, "scheduling_policy", "fcfs"),
            long_rope_from=long_rope_from,
            long_prefill_token_threshold=getattr(config, "long_prefill_token_threshold", 0))
        if self._forwarded is not None:
            self._forwarded.append(self.config)
        if self._file is not None:
            with self._write_lock:
                self._file.write(encode_line(msgspec.structs.replace(self.config, capacity=0))
                                 + b"\n")

    def forward(self) -> None:
        """Keep every record made from now on (the configuration's too) for ``take_new``, and
        no more in a ring: an engine-core process's recorder, whose records go to the
        frontend's ring (a second ring here would hold ~45 MiB that nobody reads)."""
        self._forwarded = deque([self.config] if self.config is not None else [])
        self._records = deque(maxlen=0)

    def take_new(self) -> list[Record]:
        """The records made since the last call, oldest first (``forward`` first)."""
        forwarded = self._forwarded
        return [forwarded.popleft() for _ in range(len(forwarded))] if forwarded else []

    def ingest(self, records: Iterable[Record]) -> None:
        """Records another recorder made (an engine-core process's), as if made here."""
        for record in records:
            if isinstance(record, TraceConfig):
                self.config = record
                if self._file is not None:
                    with self._write_lock:
                        self._file.write(encode_line(msgspec.structs.replace(record, capacity=0))
                                         + b"\n")
            else:
                self._append(record)

    def attach(self, scheduler) -> None:
        """Read request counts and queue lengths from this ``core.scheduler.Scheduler``."""
        self._scheduler = scheduler
        self._requests = scheduler.requests

    def wrap(self, ref, sender: str, receiver: str) -> TracedRef:
        return TracedRef(ref, self, sender, receiver)

    # --- hooks --------------------------------------------------------------------------------

    def on_transition(self, machine, move) -> None:
        """A ``Machine`` listener: one ``StateChange`` per transition."""
        request = self._requests.get(machine.name)
        if request is None:
            self._append(StateChange(self._now(), self.step, machine.name,
                                     _STATE_NAMES[move.source], _STATE_NAMES[move.target],
                                     _EVENT_NAMES[move.event], None, 0, 0, 0, 0))
            return
        finished, admitted = move.target is _FINISHED, move.target is _RUNNING
        # an admission starts computing at its prefix-cache hit
        cached = request.num_computed_tokens if admitted else 0
        hashes = list(request.block_hashes) if finished or admitted else []
        self._append(StateChange(
            self._now(), self.step, machine.name, _STATE_NAMES[move.source],
            _STATE_NAMES[move.target], _EVENT_NAMES[move.event],
            request.finish_reason.value if finished else None, len(request.prompt_token_ids),
            len(request.output_token_ids), request.num_computed_tokens, request.num_blocks,
            stop_reason=request.stop_reason if finished else None, num_cached_tokens=cached,
            block_hashes=hashes))

    def on_arrival(self, msg: AddRequest) -> None:
        p, lora = msg.sampling_params, msg.lora_request
        self._append(Arrival(self._now(), self.next_step_id, msg.request_id,
                             len(msg.prompt_token_ids), p.n, p.max_tokens, p.min_tokens,
                             p.ignore_eos, list(p.stop_token_ids or ()), msg.arrival_time,
                             lora.lora_name if lora is not None else None,
                             lora.lora_int_id if lora is not None else 0, msg.priority))

    def on_control(self, msg: AbortRequests | StopRequests) -> None:
        now, step = self._now(), self.next_step_id
        if isinstance(msg, StopRequests):
            record = Stop(now, step, list(msg.request_ids), list(msg.stop_reasons))
        else:
            record = Abort(now, step, list(msg.request_ids))
        self._append(record)

    def before_plan(self) -> None:
        self.step = self.next_step_id

    def planned(self, plan) -> None:
        """``Scheduler.schedule()`` proposed ``plan`` (queue lengths are still the pre-step ones)."""
        self.next_step_id = plan.step_id + 1
        s = self._scheduler
        self._pending = _PendingStep(plan, self._now(), len(s.running) if s else 0,
                                     len(s.waiting) if s else 0)

    def granted(self, plan, granted, ran: bool) -> None:
        """The allocator granted ``plan``; ``ran`` is False when the step runs nothing."""
        pending = self._pending
        if pending is None or pending.plan is not plan:
            return
        pending.granted = granted
        if not ran:
            self._emit_step(pending, self._now(), [], None)
            return
        # the grant has cut each request's drafts to the budget: these are the ones verified
        # (copied: the scheduler replaces them when the step's result arrives)
        drafts = [r.spec_token_ids for r in plan.requests]
        if any(drafts):
            pending.drafts = [list(d) for d in drafts]

    def step_result(self, plan, result) -> None:
        """The step's result arrived (before the scheduler applies it)."""
        self.step = result.step_id
        pending = self._pending
        if pending is not None and pending.plan is plan:
            self._emit_step(pending, self._now(), list(result.failed_request_ids), result.error,
                            result.fault, list(result.blame_request_ids), result.timings,
                            result.rank_timings, (result.router_s, result.experts_s),
                            _num_accepted(pending, result))

    # --- export -------------------------------------------------------------------------------

    @property
    def num_recorded(self) -> int:
        """Records made so far (including those the ring buffer has let go of)."""
        with self._read_lock:
            taken = next(self._seq)
            count = taken - self._num_reads
            self._num_reads += 1
        return count

    @property
    def num_dropped(self) -> int:
        """Records the ring buffer has let go of."""
        return max(0, self.num_recorded - len(self._records))

    def records(self) -> list[Record]:
        """The configuration record (if known) followed by the ring buffer's contents."""
        body = list(self._records)  # one C-level copy: no append interleaves with it
        dropped = self.num_dropped
        head = [msgspec.structs.replace(self.config, num_dropped=dropped)] if self.config else []
        return head + body

    def latest(self, kind: type) -> Record | None:
        """The most recent record of type ``kind`` still in the buffer."""
        return next((r for r in reversed(self._records.copy()) if isinstance(r, kind)), None)

    def jsonl_lines(self) -> list[str]:
        """The trace as JSON lines (no newlines), configuration first: ``GET /trace.json``."""
        return list(jsonl_lines(self.records()))

    def flush(self) -> None:
        """Write every record made so far to the file (a no-op without ``path``)."""
        with self._write_lock:
            if self._file is not None:
                self._write_locked()
                self._file.flush()

    def close(self) -> None:
        with self._write_lock:
            if self._file is not None:
                self._write_locked()
                self._file.close()
                self._file = None

    # --- internals ----------------------------------------------------------------------------

    def _append(self, record: Record) -> None:
        # deque and list appends are atomic: recording threads never wait for each other
        self._take()
        self._records.append(record)
        if self._forwarded is not None:
            self._forwarded.append(record)
        if self._file is not None:
            self._unwritten.append(record)
            if len(self._unwritten) >= _WRITE_BATCH and self._write_lock.acquire(blocking=False):
                try:
                    if self._file is not None:
                        self._write_locked()
                finally:
                    self._write_lock.release()

    def _write_locked(self) -> None:
        """Write what is buffered for the file (``_write_lock`` held). Records appended
        meanwhile stay for the next write."""
        count = len(self._unwritten)
        if count:
            self._file.write(encode_lines(self._unwritten[:count]))
            del self._unwritten[:count]

    def _emit_step(self, pending: _PendingStep, t_end: float, failed_ids: list[str],
                   error: str | None, fault: str | None = None,
                   blamed_ids: list[str] = (), timings: list[float] = (),
                   rank_timings: list[list[float]] = (),
                   moe_seconds: tuple[float | None, float | None] = (None, None),
                   num_accepted: list[int] = ()) -> None:
        self._pending = None
        plan, granted = pending.plan, pending.granted
        counts = list(plan.num_scheduled_tokens)
        num_prefill = sum([n for n, p in zip(counts, plan.is_prefill) if p])
        total = self._num_usable_blocks if self.config else 0
        free = granted.num_free_blocks if granted is not None else 0
        per_group = list(granted.num_used_blocks) if granted is not None else []
        self._append(StepSummary(
            step=plan.step_id, t_start=pending.t_start, t_end=t_end,
            duration_s=t_end - pending.t_start,
            request_ids=[r.request_id for r in plan.requests], num_scheduled_tokens=counts,
            is_prefill=list(plan.is_prefill), num_prefill_tokens=num_prefill,
            num_decode_tokens=sum(counts) - num_prefill, preempted_ids=list(plan.preempted_ids),
            failed_ids=failed_ids, kv_blocks_used=sum(per_group) if per_group else total - free,
            kv_blocks_free=free, kv_blocks_per_group=per_group,
            kv_blocks_cached=granted.num_cached_blocks if granted is not None else 0,
            num_running=pending.num_running, num_waiting=pending.num_waiting, error=error,
            fault=fault, blamed_ids=list(blamed_ids), num_cached_tokens=plan.num_cached_tokens,
            rank_timings=[list(t) for t in rank_timings], router_s=moe_seconds[0],
            experts_s=moe_seconds[1], draft_token_ids=pending.drafts,
            num_accepted_tokens=list(num_accepted), **dict(zip(_TIMINGS, timings))))


def _num_accepted(pending: _PendingStep, result) -> list[int]:
    """Per plan request, how many of its drafts ``result`` accepted (empty: no drafts). A
    request the step did not sample (failed, faulted) accepted none."""
    if not pending.drafts:
        return []
    accepted = dict(zip(result.request_ids, map(len, result.accepted_token_ids)))
    return [accepted.get(r.request_id, 0) for r in pending.plan.requests]
