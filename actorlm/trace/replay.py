"""Replay a recorded trace through the real scheduler and allocator, and compare every step.

``SyncEngine`` is the engine's scheduling half run in one thread: the scheduler actor's own
loop (``core.step_loop.StepLoop``), the real ``Scheduler`` and ``BlockPool``, and
``testing.fake_runner.FakeModelRunner`` for the model. Every message the loop sends lands in an
outbox the engine routes itself, so the order in which the scheduler handles messages is
exactly the order the caller chooses.

The recording says what that order was: arrivals, aborts, stops and step summaries
are all recorded on the scheduler's thread, as it handles them. The replay walks them in
recorded order — an ``arrival`` becomes an ``AddRequest``, an ``abort`` an ``AbortRequests``,
a ``stop`` a ``StopRequests``, a ``step`` delivers the held grant (a plan that only freed
blocks) or the step's result — and after each step compares the replay's plan with the
recorded one: which requests, how many tokens each, which preemptions, KV blocks in use (and
per KV-cache group: the pool serves the recorded groups' windows).

Fake tokens are not the recorded ones, so no fake token may end a request by accident: the
replay runs without EOS, and ``replay_runner.ReplayRunner`` samples a finish token (a stop
token of every replayed request) exactly where a request finished on a token in the
recording; length caps stay as recorded. Prefix-cache hits follow the recorded block hashes: a
request gets the hash chain its transitions recorded, and its fake tokens (prompt and output)
are drawn from that chain, so two requests hold equal fake tokens exactly where the recording
had them share a prefix. With speculative decoding the runner proposes, after each step, the
drafts the request's next recorded step verified, of which as many are right as that step
accepted. A stop string arrives as the recorded ``StopRequests``. Request failures the
recording saw are injected into the fake runner, and a worker fault is answered as the
executor answered it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace

import msgspec

from actorlm.core.block_pool import BlockPool
from actorlm.testing.fake_runner import FakeModelRunner
from actorlm.core.scheduler import Scheduler, SchedulerConfig
from actorlm.core.step_loop import StepLoop
from actorlm.messages import (AbortRequests, AddRequest, ScheduleStep, SlotsGranted, StepResult,
                              StopRequests, engine_request_ids)
from actorlm.sampling_params import SamplingParams
from actorlm.trace.recorder import TraceRecorder
from actorlm.trace.replay_runner import (FINISH_TOKEN, RecordedDrafts, ReplayRunner, token_at,
                                         token_finish_positions)
from actorlm.trace.records import (TRACE_VERSION, Abort, Arrival, Record, StateChange,
                                   StepSummary, Stop, TraceConfig)


class TraceIncomplete(ValueError):
    """The trace cannot be replayed: no configuration, or the ring buffer dropped records."""


class SyncEngine:
    """The real scheduler loop, allocator pool and a fake model runner, in one thread.

    ``send(message)`` hands the scheduler one message and routes what it sends: allocation
    asks are granted at once; a grant for a plan that runs requests is handed back at once;
    a grant for a plan that only frees blocks, and each ``ScheduleStep``, are held until
    ``deliver_held()`` (so a caller can place other messages before them).
    """

    def __init__(self, config: TraceConfig | SchedulerConfig, num_kv_blocks: int | None = None,
                 *, recorder: TraceRecorder | None = None, runner: FakeModelRunner | None = None,
                 check_kv: bool = True, kv_cache_windows: list[int | None] | None = None):
        if isinstance(config, TraceConfig):
            num_kv_blocks = config.num_kv_blocks
            kv_cache_windows = config.kv_cache_windows
            config = SchedulerConfig(config.max_num_batched_tokens, config.max_num_seqs,
                                     config.max_model_len, config.block_size,
                                     config.enable_chunked_prefill, frozenset(config.eos_token_ids),
                                     config.enable_prefix_caching, max_loras=config.max_loras,
                                     scheduling_policy=config.scheduling_policy,
                                     long_rope_from=config.long_rope_from,
                                     long_prefill_token_threshold=(
                                         config.long_prefill_token_threshold))
        self.recorder = recorder
        windows = list(kv_cache_windows or [None])  # one per KV-cache group
        listeners = [recorder.on_transition] if recorder is not None else []
        self.scheduler = Scheduler(config, listeners=listeners)
        if recorder is not None:
            recorder.configure(SimpleNamespace(
                num_kv_blocks=num_kv_blocks, enable_lora=bool(config.max_loras), **{
                name: getattr(config, name) for name in (
                    "max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size",
                    "enable_chunked_prefill", "enable_prefix_caching", "max_loras",
                    "scheduling_policy", "long_prefill_token_threshold")}),
                config.eos_token_ids, "replay", windows, config.long_rope_from)
            recorder.attach(self.scheduler)
        self.pool = BlockPool(num_kv_blocks, config.block_size, config.enable_prefix_caching,
                              windows)
        self.runner = runner or FakeModelRunner(
            block_size=config.block_size if check_kv else None,
            num_blocks=num_kv_blocks if check_kv else None, windows=windows)
        self._outbox: deque = deque()
        self.loop = StepLoop(self.scheduler, lambda peer, message:
                             self._outbox.append((peer, message)), recorder)
        self.next_step_id = 0  # the next step the scheduler will plan
        self.held: SlotsGranted | ScheduleStep | None = None
        self.outputs: list = []  # EngineOutputs the scheduler sent, in order

    def send(self, message) -> None:
        self.loop.handle(message)
        self._route()

    def deliver_held(self, recorded: StepSummary | None = None) -> None:
        """Hand the scheduler what it waits for: the held grant, or the step's result — the
        fault the ``recorded`` step had, else the fake runner's (failing the requests the
        recording saw fail)."""
        held, self.held = self.held, None
        if isinstance(held, ScheduleStep):
            if recorded is not None and recorded.fault is not None:
                self.runner.fresh()  # the worker was replaced: it holds nothing any more
                held = StepResult(held.step_id, [], [], fault=recorded.fault,
                                  blame_request_ids=list(recorded.blamed_ids))
            else:
                for request_id in recorded.failed_ids if recorded is not None else ():
                    self.runner.fail_request(request_id, "failed in the recording")
                held = self.runner.execute(held)
        self.send(held)

    def run_until_idle(self, max_steps: int = 1_000_000) -> int:
        """Deliver held messages until nothing is in flight; returns the steps run."""
        for num_steps in range(max_steps):
            if self.held is None:
                return num_steps
            self.deliver_held()
        raise RuntimeError(f"still busy after {max_steps} steps")

    def _route(self) -> None:
        while self._outbox:
            dest, message = self._outbox.popleft()
            if dest == "allocator":
                self.next_step_id = message.step_id + 1
                granted = self.pool.grant(message)
                if self.loop.plan.runs_with(granted):
                    self.loop.handle(granted)  # the step's requests run: no choice here
                else:
                    self._hold(granted)  # the next plan follows it at once: keep the order
            elif dest == "executor":
                self._hold(message)
            else:
                self.outputs.append(message)

    def _hold(self, message) -> None:
        if self.held is not None:
            raise RuntimeError(f"the scheduler sent {type(message).__name__} while "
                               f"{type(self.held).__name__} was still held")
        self.held = message


@dataclass
class Divergence:
    step: int
    reason: str
    recorded: StepSummary | None = None
    replayed: StepSummary | None = None

    def describe(self) -> str:
        lines = [f"first divergent step: {self.step}: {self.reason}"]
        for label, s in (("recorded", self.recorded), ("replayed", self.replayed)):
            if s is not None:
                lines.append(f"  {label:>8}: {_describe_step(s)}")
        return "\n".join(lines)


@dataclass
class ReplayReport:
    num_steps: int  # recorded steps replayed and compared
    num_requests: int
    divergence: Divergence | None = None
    replayed: list[Record] = field(default_factory=list)  # the replay's own trace

    @property
    def matched(self) -> bool:
        return self.divergence is None

    def describe(self) -> str:
        if self.matched:
            return (f"replay matches: {self.num_steps} steps, {self.num_requests} requests "
                    f"(schedules, token counts, preemptions and KV blocks identical)")
        return self.divergence.describe()


def replay_trace(records: list[Record], *, check_kv: bool = True) -> ReplayReport:
    """Re-drive the recorded arrivals and stops through the real scheduler; compare steps."""
    if not records or not isinstance(records[0], TraceConfig):
        raise TraceIncomplete("the trace does not start with its configuration record")
    config = records[0]
    if config.version != TRACE_VERSION:
        raise TraceIncomplete(f"trace format version {config.version} is not {TRACE_VERSION}, "
                              f"the one this actorlm replays")
    if config.num_dropped:
        raise TraceIncomplete(f"the ring buffer dropped {config.num_dropped} records before "
                              f"this export; replay needs a complete trace (use a trace file)")
    chains = _hash_chains(records)
    recorder = TraceRecorder(capacity=2 * len(records) + 64)
    runner = ReplayRunner(chains, config.block_size, check_kv and config.num_kv_blocks,
                          config.kv_cache_windows or [None], token_finish_positions(records),
                          RecordedDrafts(records) if config.num_speculative_tokens else None)
    engine = SyncEngine(msgspec.structs.replace(config, eos_token_ids=[]), recorder=recorder,
                        runner=runner)
    report = ReplayReport(0, 0)
    for record in records[1:]:
        if isinstance(record, StepSummary):
            divergence = _replay_step(engine, recorder, record)
            report.num_steps += 1
        elif isinstance(record, (Arrival, Abort, Stop)):
            divergence = _check_key(engine, record)
            if divergence is None:
                if isinstance(record, Arrival):
                    report.num_requests += 1
                engine.send(_message(record, chains, config.block_size))
                if isinstance(record, Arrival):
                    _follow_recording(engine.scheduler, record, chains)
        else:
            continue
        if divergence is None and engine.runner.violations:
            divergence = Divergence(engine.next_step_id - 1, "the fake runner caught a KV "
                                    "bookkeeping fault: " + "; ".join(engine.runner.violations))
        if divergence is not None:
            report.divergence = divergence
            break
    else:
        if isinstance(engine.held, ScheduleStep) and _all_finished(records):
            report.divergence = Divergence(engine.held.step_id, "the replay runs a step the "
                                           "recording does not have (it ends idle)")
    report.replayed = recorder.records()
    return report


def _check_key(engine: SyncEngine, record) -> Divergence | None:
    if record.step == engine.next_step_id:
        return None
    what = record.request_id if isinstance(record, Arrival) else ", ".join(record.request_ids)
    kind = type(record).__name__.lower()
    return Divergence(min(record.step, engine.next_step_id),
                      f"{kind} of {what} reached the scheduler before step {record.step} in "
                      f"the recording, before step {engine.next_step_id} in the replay")


def _replay_step(engine: SyncEngine, recorder: TraceRecorder, recorded: StepSummary):
    held = engine.held
    if held is None:
        return Divergence(recorded.step, "the recording ran this step; the replay is idle",
                          recorded)
    if held.step_id != recorded.step:
        return Divergence(min(held.step_id, recorded.step),
                          f"the recording handles step {recorded.step} next, the replay "
                          f"step {held.step_id}", recorded)
    engine.deliver_held(recorded)
    replayed = recorder.latest(StepSummary)
    if replayed is None or replayed.step != recorded.step:
        return Divergence(recorded.step, "the replay produced no summary for this step",
                          recorded, replayed)
    for name, label in (("request_ids", "scheduled requests"),
                        ("num_scheduled_tokens", "token counts"),
                        ("preempted_ids", "preemptions"), ("kv_blocks_used", "KV blocks in use")):
        if getattr(recorded, name) != getattr(replayed, name):
            return Divergence(recorded.step, f"{label} differ", recorded, replayed)
    if recorded.kv_blocks_per_group and \
            recorded.kv_blocks_per_group != replayed.kv_blocks_per_group:  # (older traces lack it)
        return Divergence(recorded.step, "KV blocks per group differ", recorded, replayed)
    return None


def _message(record, chains: dict[str, list[int]], block_size: int):
    if isinstance(record, Arrival):
        params = SamplingParams(n=record.n, max_tokens=record.max_tokens, temperature=0.0,
                                ignore_eos=True, stop_token_ids=[FINISH_TOKEN])
        chain = chains.get(engine_request_ids(record.request_id, record.n)[0], [])
        prompt = [token_at(chain, p, block_size) or 1 + p % 7
                  for p in range(record.num_prompt_tokens)]
        return AddRequest(record.request_id, prompt, params, 0, record.arrival_time,
                          lora_request=record.lora_request, priority=record.priority)
    if isinstance(record, Stop):
        return StopRequests(list(record.request_ids), list(record.stop_reasons))
    return AbortRequests(list(record.request_ids))


def _follow_recording(scheduler: Scheduler, arrival: Arrival,
                      chains: dict[str, list[int]]) -> None:
    """Each request (or child) hashes its blocks as it did in the recording."""
    for request_id in engine_request_ids(arrival.request_id, arrival.n):
        request = scheduler.requests.get(request_id)
        if request is not None:
            request.block_hashes = list(chains.get(request_id, ()))


def _hash_chains(records: list[Record]) -> dict[str, list[int]]:
    """Each request's longest recorded chain of block hashes (empty without prefix caching)."""
    chains: dict[str, list[int]] = {}
    for r in records:
        if isinstance(r, StateChange) and len(r.block_hashes) > len(chains.get(r.request_id, ())):
            chains[r.request_id] = r.block_hashes
    return chains


def _all_finished(records: list[Record]) -> bool:
    live = set()
    for r in records:
        if isinstance(r, Arrival):
            live.update(engine_request_ids(r.request_id, r.n))
        elif isinstance(r, StateChange) and r.target == "finished":
            live.discard(r.request_id)
    return not live


def _describe_step(s: StepSummary) -> str:
    scheduled = ", ".join(f"{rid}:{n}" for rid, n in zip(s.request_ids, s.num_scheduled_tokens))
    text = f"[{scheduled}]"
    if s.preempted_ids:
        text += f" preempted [{', '.join(s.preempted_ids)}]"
    text += f" kv_used={s.kv_blocks_used}"
    if len(s.kv_blocks_per_group) > 1:
        text += f" per group {s.kv_blocks_per_group}"
    return text
