"""EngineHarness: the real actors, driven one engine step at a time.

The harness starts the real FrontendActor, SchedulerActor, KVAllocatorActor and ExecutorActor
(through ``EngineSystem``) around a ``FakeModelRunner`` (or a real model), and places a relay
probe in front of every actor: each actor's peers are given the relay's ref instead of the
actor's own. Every message between actors therefore lands in one journal, and the harness
delivers them itself, one at a time, in the order they were sent, each with a blocking ``ask``
that returns once the receiver has handled it. That makes a run deterministic — exactly one
actor is ever busy, and the harness knows when all of them are quiet — without changing a line
of actor code and without sleeping.

One seam defines a step: the ``ScheduleStep`` the scheduler sends to the executor is held.
``step()`` releases it, waits for its ``StepResult``, and delivers everything that follows
until the scheduler has planned (and the allocator granted) the next step, which is held in
turn. Between calls the engine is quiet with at most one step pending, so a test can look at
states, add requests or abort them; what it adds or aborts takes effect exactly where it would
in a free-running engine (an abort waits for the step in flight; a request added to an idle
engine starts a step at once, one added while a step is pending joins the next plan).
"""

from __future__ import annotations

import threading
from collections import deque
from types import SimpleNamespace
from typing import Any, Iterable, Sequence

import pykka

from actorlm import messages
from actorlm.actors.system import EngineSystem
from actorlm.config import EngineConfig
from actorlm.fsm import RequestEvent, RequestState
from actorlm.fsm.machine import Machine, Transition
from actorlm.kv_groups import KVCacheGroup
from actorlm.messages import (AbortRequests, AddRequest, EngineOutputs, GetStats, KVStats,
                              ScheduleStep, SchedulerStats, StepResult, SubmitRequest)
from actorlm.models.parts import ModelParts
from actorlm.outputs import RequestOutput
from actorlm.sampling_params import SamplingParams
from actorlm.testing.fake_runner import FakeModelRunner
from actorlm.testing.probe import TestProbe
from actorlm.testing.records import RequestRecord, StepRecord
from actorlm.testing.tokenizer import ToyTokenizer


class _Relay(TestProbe):
    """A probe that stands for one real actor: what it receives goes to the harness journal."""

    def __init__(self, name: str, harness: EngineHarness):
        self._harness = harness
        super().__init__(name)

    def _record(self, message, reply_to) -> None:
        self._harness._enqueue(self.name, message, reply_to)


class _Sink:
    def __init__(self, harness: EngineHarness):
        self._harness = harness

    def put(self, output: RequestOutput) -> None:
        self._harness.request_outputs.setdefault(output.request_id, []).append(output)


class EngineHarness:
    """The real engine actors around a ``FakeModelRunner``, stepped by hand.

    Without ``model``, no weights or tokenizer load: prompts are token ids (or text for the
    ``ToyTokenizer``), and the fake runner gets the harness's block geometry so it can check
    the KV bookkeeping. With ``model`` (a path), the real model runs under the same control.
    Keyword flags are ``EngineConfig`` flags; the defaults are small so that chunking and
    preemption are easy to provoke. ``wrap_runner`` wraps each runner the workers get (a
    ``FaultInjector``'s ``wrap`` makes them fault). ``kv_cache_windows`` (fake runner only):
    one KV-cache group per entry with that window (None: full attention), served by the block
    pool and checked by the fake runner; default one full group.
    """

    def __init__(self, *, runner: FakeModelRunner | None = None, model: str | None = None,
                 clock=None, tokenizer=None, eos_token_ids: Iterable[int] = (),
                 vocab_size: int = 1000, timeout: float = 60.0, num_kv_blocks: int = 64,
                 block_size: int = 4, max_model_len: int = 64,
                 max_num_batched_tokens: int | None = 32, max_num_seqs: int = 8, trace=None,
                 wrap_runner=None, kv_cache_windows: Sequence[int | None] | None = None,
                 **engine_flags):
        self.timeout = timeout
        self.max_messages_per_pump = 10_000  # more between two steps is a message storm
        self.clock = clock
        self.requests: dict[str, RequestRecord] = {}  # engine-side id -> record
        self.request_outputs: dict[str, list[RequestOutput]] = {}  # caller's id -> outputs
        self.messages: list[tuple[str, Any]] = []  # (receiving actor, message), in delivery order
        self.scheduled_steps: list[ScheduleStep] = []  # every step the scheduler sent
        self.steps: list[StepRecord] = []
        self.pending_step: ScheduleStep | None = None
        self._journal: deque[tuple[str, Any, pykka.Future | None]] = deque()
        self._cond = threading.Condition()
        self._lock = threading.Lock()
        # every state transition so far: (request id, from, event, to), in order
        self.transitions: list[tuple[str, RequestState, RequestEvent, RequestState]] = []
        self._targets: dict[str, pykka.ActorRef] = {}
        self._relays: dict[str, _Relay] = {}  # by the actor each stands for
        self._sink = _Sink(self)
        self.system: EngineSystem | None = None
        flags = dict(num_kv_blocks=num_kv_blocks, block_size=block_size,
                     max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                     max_num_seqs=max_num_seqs, **engine_flags)
        system_kwargs = dict(listeners=[self._on_transition], peer=self._relay_to,
                             wrap_runner=wrap_runner)
        if clock is not None:
            system_kwargs["clock"] = clock
        if trace is not None:  # an actorlm.trace.TraceRecorder: the run can be rendered
            system_kwargs["trace"] = trace
        try:
            if model is not None:
                if runner is not None:
                    raise ValueError("pass either model (a real runner) or runner, not both")
                if kv_cache_windows is not None:
                    raise ValueError("a real model brings its own KV-cache groups")
                self.runner = None
                self.system = EngineSystem(EngineConfig.from_flags(model, **flags),
                                           **system_kwargs)
            else:
                config = EngineConfig.from_flags(None, **flags).resolve(
                    SimpleNamespace(max_position_embeddings=max_model_len), kv_bytes_per_block=1)
                eos = frozenset(eos_token_ids)
                windows = tuple(kv_cache_windows) if kv_cache_windows is not None else None
                if runner is None:
                    runner = FakeModelRunner(vocab_size=vocab_size, block_size=block_size,
                                             num_blocks=config.num_kv_blocks, clock=clock,
                                             windows=windows or (None,))
                else:
                    if windows is not None and runner.windows != windows:
                        raise ValueError(f"the runner's KV-cache windows {runner.windows} are "
                                         f"not kv_cache_windows {windows}")
                    windows = runner.windows
                    if runner.clock is None:
                        runner.clock = clock
                self.runner = runner
                tokenizer = tokenizer or ToyTokenizer(vocab_size, min(eos) if eos else None)
                # one (fake) layer per group
                groups = tuple(KVCacheGroup(w, (g,)) for g, w in enumerate(windows or ()))
                parts = ModelParts("FakeModelRunner", tokenizer, lambda rank: runner.fresh(),
                                   vocab_size, eos, groups)
                self.system = EngineSystem(config, parts=parts, **system_kwargs)
            self.config = self.system.config
            self.tokenizer = self.system.tokenizer
            self.scheduler_stats()  # a barrier: the scheduler has its peers (Connect)
        except BaseException:
            self.close()
            raise

    # --- the test's controls ------------------------------------------------------------------

    def add_request(self, prompt: list[int] | str, sampling_params: SamplingParams | None = None,
                    *, request_id: str | None = None, stream: bool = False, priority: int = 0,
                    **params) -> str:
        """Submit through the frontend (validation included: a bad prompt raises ValueError).
        Without ``sampling_params``, ``params`` build one with ``temperature=0`` by default.
        Returns the request id."""
        if sampling_params is None:
            sampling_params = SamplingParams(**{"temperature": 0.0, **params})
        elif params:
            raise ValueError("pass sampling_params or keyword params, not both")
        request_id = request_id if request_id is not None else f"r{len(self.request_outputs)}"
        self.request_outputs.setdefault(request_id, [])
        self._ask("frontend", SubmitRequest(request_id, prompt, sampling_params, self._sink,
                                            stream, priority=priority))
        self._pump()
        return request_id

    def abort(self, *request_ids: str) -> None:
        """Abort through the frontend, as a client disconnect does. Applied by the scheduler
        at once when the engine is idle, else after the pending step (``step()``)."""
        self._ask("frontend", AbortRequests(list(request_ids)))
        self._pump()

    def step(self) -> StepRecord | None:
        """Run exactly one engine step; None when the engine is idle (nothing to run)."""
        self._pump()
        step = self.pending_step
        if step is None:
            return None
        self.pending_step = None
        num_messages, num_transitions = len(self.messages), len(self.transitions)
        self._ask("executor", step)
        with self._cond:
            if not self._cond.wait_for(lambda: self._journal, self.timeout):
                raise AssertionError(f"step {step.step_id}: no StepResult within {self.timeout} s")
            dest, result, _ = self._journal[0]
        if not isinstance(result, StepResult):
            raise AssertionError(f"step {step.step_id}: expected a StepResult for the scheduler, "
                                 f"got {result!r} for {dest}")
        self._pump()
        outputs = [m for d, m in self.messages[num_messages:]
                   if d == "frontend" and isinstance(m, EngineOutputs)]
        record = StepRecord(step, result, outputs, self.transitions[num_transitions:],
                            self.clock.now() if self.clock is not None else None)
        self.steps.append(record)
        if self.runner is not None and self.runner.violations:
            raise AssertionError("the fake model runner caught a bookkeeping fault:\n  " +
                                 "\n  ".join(self.runner.violations))
        return record

    def run_until_idle(self, max_steps: int = 10_000) -> list[StepRecord]:
        """Step until nothing is left to run; raises if requests are still unfinished then."""
        records = []
        for _ in range(max_steps):
            record = self.step()
            if record is None:
                if stuck := self.unfinished_ids:
                    states = {rid: self.requests[rid].state.name for rid in stuck}
                    raise AssertionError(f"the engine went idle with unfinished requests: "
                                         f"{states}")
                return records
            records.append(record)
        raise AssertionError(f"still busy after {max_steps} steps")

    # --- what the test can look at ------------------------------------------------------------

    @property
    def unfinished_ids(self) -> list[str]:
        with self._lock:
            return [rid for rid, r in self.requests.items() if not r.is_finished]

    def output(self, request_id: str) -> RequestOutput | None:
        """The frontend's final ``RequestOutput`` for a caller's request id (None if running)."""
        outputs = [o for o in self.request_outputs.get(request_id, []) if o.finished]
        return outputs[-1] if outputs else None

    def kv_stats(self) -> KVStats:
        """The allocator's own counts (the truth, not the scheduler's planning view)."""
        return self._targets["allocator"].ask(GetStats(), timeout=self.timeout)

    def scheduler_stats(self) -> SchedulerStats:
        return self._targets["scheduler"].ask(GetStats(), timeout=self.timeout)

    @property
    def num_free_blocks(self) -> int:
        return self.kv_stats().num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.kv_stats().num_total_blocks

    def check_invariants(self) -> None:
        """Assert the engine's invariants (docs/architecture.md) on everything seen so far: no
        step over ``max_num_batched_tokens`` / ``max_num_seqs``; no finished request finished
        twice or without exactly one finishing delta; no fake-runner violation; and, once idle,
        every block back in the pool."""
        cfg, problems = self.config, []
        for step in self.scheduled_steps:
            num_tokens, num_seqs = sum(step.num_scheduled_tokens), len(step.num_scheduled_tokens)
            if num_tokens > cfg.max_num_batched_tokens:
                problems.append(f"step {step.step_id} schedules {num_tokens} tokens > "
                                f"max_num_batched_tokens {cfg.max_num_batched_tokens}")
            if num_seqs > cfg.max_num_seqs:
                problems.append(f"step {step.step_id} runs {num_seqs} requests > "
                                f"max_num_seqs {cfg.max_num_seqs}")
        with self._lock:
            records = list(self.requests.values())
        for r in records:
            num_finishes = sum(1 for *_, target in r.transitions if target is RequestState.FINISHED)
            if r.is_finished and (num_finishes != 1 or r.num_finish_deltas != 1):
                problems.append(f"{r.request_id} finished {num_finishes} times with "
                                f"{r.num_finish_deltas} finishing deltas")
            if not r.is_finished and r.num_finish_deltas:
                problems.append(f"{r.request_id} got a finish delta in state {r.state.name}")
        if self.runner is not None:
            problems += self.runner.violations
        if self.pending_step is None and not self.unfinished_ids:
            kv = self.kv_stats()
            if kv.num_free_blocks != kv.num_total_blocks or kv.num_requests_holding_blocks:
                problems.append(f"idle but blocks are held: {kv}")
            stats = self.scheduler_stats()
            if stats.num_running or stats.num_waiting:
                problems.append(f"idle but the scheduler has requests: {stats}")
        if problems:
            raise AssertionError("engine invariants broken:\n  " + "\n  ".join(problems))

    # --- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop every actor and relay the harness started."""
        if self.system is not None:
            self.system.stop()
        for relay in self._relays.values():
            relay.stop()

    def __enter__(self) -> EngineHarness:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- the machinery ------------------------------------------------------------------------

    def _relay_to(self, ref: pykka.ActorRef, sender: str, receiver: str) -> pykka.ActorRef:
        """What each actor is given to reach ``receiver``: one relay into the journal."""
        if receiver not in self._relays:
            self._relays[receiver] = _Relay(receiver, self)
            self._targets[receiver] = ref
        return self._relays[receiver].ref

    def _enqueue(self, dest: str, message, reply_to) -> None:
        with self._cond:
            self._journal.append((dest, message, reply_to))
            self._cond.notify_all()

    def _pump(self) -> None:
        """Deliver journal messages in order until only the held step (if any) remains."""
        for _ in range(self.max_messages_per_pump):
            with self._cond:
                if not self._journal:
                    return
                dest, message, reply_to = self._journal.popleft()
            if dest == "executor" and isinstance(message, ScheduleStep):
                if self.pending_step is not None:
                    raise AssertionError(f"step {message.step_id} sent while step "
                                         f"{self.pending_step.step_id} is still in flight")
                self.pending_step = message
                self.scheduled_steps.append(message)
                continue
            answer = self._ask(dest, message)
            if reply_to is not None:
                reply_to.set(answer)
        raise AssertionError(f"the actors never went quiet: {self.max_messages_per_pump} "
                             f"messages without a step; last: {self.messages[-3:]}")

    def _ask(self, dest: str, message):
        self.messages.append((dest, message))
        self._observe(dest, message)
        try:
            return self._targets[dest].ask(message, timeout=self.timeout)
        except pykka.Timeout:
            raise AssertionError(f"{dest} did not handle {type(message).__name__} within "
                                 f"{self.timeout} s") from None

    def _now(self) -> float | None:
        return self.clock.now() if self.clock is not None else None

    def _observe(self, dest: str, message) -> None:
        if dest == "scheduler" and isinstance(message, AddRequest):
            engine_ids = messages.engine_request_ids(message.request_id,
                                                     message.sampling_params.n)
            with self._lock:
                for engine_id in engine_ids:
                    self.requests.setdefault(engine_id, RequestRecord(
                        engine_id, list(message.prompt_token_ids),
                        arrival_time=message.arrival_time))
        elif dest == "frontend" and isinstance(message, EngineOutputs):
            now = self._now()
            with self._lock:
                for delta in message.deltas:
                    record = self._record_for(delta.request_id)
                    if delta.new_token_ids and not record.output_token_ids:
                        record.first_token_time = now
                    record.output_token_ids.extend(delta.new_token_ids)
                    if delta.finish_reason is not None:
                        record.num_finish_deltas += 1
                        record.finish_reason, record.stop_reason = (delta.finish_reason,
                                                                    delta.stop_reason)
                        record.error, record.finish_time = delta.error, now

    def _record_for(self, request_id: str) -> RequestRecord:
        record = self.requests.get(request_id)
        if record is None:
            record = self.requests[request_id] = RequestRecord(request_id)
        return record

    def _on_transition(self, machine: Machine, transition: Transition) -> None:
        # called on the scheduler's thread while the harness waits on its ask
        with self._lock:
            record = self._record_for(machine.name)
            record.state = transition.target
            record.transitions.append((transition.source, transition.event, transition.target))
            self.transitions.append((machine.name, transition.source, transition.event,
                                      transition.target))
