"""The engine loop the SchedulerActor runs, as a plain class: it reacts to one message at a time
and says what to send, through ``send(peer, message)`` with peer "frontend", "allocator" or
"executor". The actor wires ``send`` to its peers' refs; a trace replay wires it to a queue it
routes itself, so both run exactly this code.

One step is a chain of messages, never a blocking ask:
propose → ``AllocateSlots`` to the allocator → ``SlotsGranted`` → ``ScheduleStep`` to the
executor → ``StepResult`` → apply, propose the next step at once, ``EngineOutputs`` to the
frontend. An idle engine sleeps until the next ``AddRequest``.

Aborts and stops that arrive while a step is in flight wait until its result is applied, so a
step's requests never change under it. A request whose data makes intake raise is refused
alone.

Structured outputs: a constrained request's grammar compiles on the compiler's thread
(``GrammarCompiled`` comes back here); until then it waits and the others run. In a step where
constrained requests sample, the loop fills their ``GrammarBitmask`` right after sending the
``ScheduleStep``, while the workers run the forward; they sample once it arrives.
"""

from __future__ import annotations

import logging
import time
from enum import Enum
from typing import Callable

from actorlm.core.request import RequestRefused
from actorlm.core.scheduler import Scheduler
from actorlm.core.step_plan import StepPlan
from actorlm.core.structured_output import GrammarCompiler, fill_bitmask
from actorlm.fsm import RequestEvent
from actorlm.messages import (AbortRequests, AddRequest, EngineOutputs, GrammarBitmask,
                              GrammarCompiled, RequestDelta, SchedulerStats, SlotsGranted,
                              StepResult, StopRequests, engine_request_ids)

log = logging.getLogger(__name__)


class _Phase(Enum):
    IDLE = "idle"
    ALLOCATING = "allocating"  # AllocateSlots sent, waiting for the grant
    RUNNING = "running"  # ScheduleStep sent, waiting for the result


class StepLoop:
    def __init__(self, scheduler: Scheduler, send: Callable[[str, object], None], trace=None,
                 grammars: GrammarCompiler | None = None, clock=time.monotonic):
        self.scheduler = scheduler
        self.send = send
        self.clock = clock
        self._running_since = 0.0  # when the step in flight went to the executor
        self.trace = trace  # an actorlm.trace.TraceRecorder, or None
        self.grammars = grammars  # None: structured outputs are refused
        self._phase = _Phase.IDLE
        self._plan: StepPlan | None = None
        self._deferred: list[AbortRequests | StopRequests] = []
        self.num_steps = 0

    @property
    def plan(self) -> StepPlan | None:
        """The step being allocated or run (None when idle)."""
        return self._plan

    def handle(self, message) -> None:
        if isinstance(message, AddRequest):
            self._on_add(message)
        elif isinstance(message, (AbortRequests, StopRequests)):
            self._on_control(message)
        elif isinstance(message, SlotsGranted):
            self._on_granted(message)
        elif isinstance(message, StepResult):
            self._on_result(message)
        elif isinstance(message, GrammarCompiled):
            deltas = self.scheduler.on_grammar(message.request_id, message.grammar, message.error)
            self._kick()
            self._send_outputs(EngineOutputs(-1, deltas))
        else:
            raise TypeError(f"the step loop cannot handle {type(message).__name__}")

    def stats(self) -> SchedulerStats:
        s = self.scheduler
        spec = s.spec_decoding
        return SchedulerStats(len(s.running), len(s.waiting), s.num_preemptions, self.num_steps,
                              s.num_finished, s.num_scheduled_tokens, s.num_prefill_tokens,
                              spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                              list(spec.accepted_per_position), *s.lora_adapters(),
                              self.clock() - self._running_since
                              if self._phase is _Phase.RUNNING else 0.0)

    # --- the loop -----------------------------------------------------------------------------

    def _on_add(self, message: AddRequest) -> None:
        try:
            if self.trace is not None:
                self.trace.on_arrival(message)
            constraint = message.sampling_params.structured_outputs
            if constraint is not None and self.grammars is None:
                raise RequestRefused(
                    "structured_outputs", "this engine has no tokenizer to compile grammars with")
            self.scheduler.add_request(message)
            if constraint is not None:
                for request_id in engine_request_ids(message.request_id,
                                                     message.sampling_params.n):
                    self.grammars.submit(request_id, constraint, message.prompt_token_ids)
        except Exception as exc:  # noqa: BLE001 — a duplicate id, bad data: refuse it alone
            log.warning("refused request %s: %s", message.request_id, exc)
            refusal = RequestDelta(message.request_id, [], "error", None, str(exc),
                                   error_field=exc.field if isinstance(exc, RequestRefused)
                                   else None)
            self.send("frontend", EngineOutputs(-1, [refusal]))
        self._kick()

    def _on_control(self, message: AbortRequests | StopRequests) -> None:
        if self.trace is not None:
            self.trace.on_control(message)
        self._deferred.append(message)
        if self._phase is _Phase.IDLE:
            deltas = self._apply_deferred()
            self._kick()  # frees travel before the news, as after a step
            self._send_outputs(EngineOutputs(-1, deltas))

    def _kick(self) -> None:
        """Start the next step if none is in flight and there is work."""
        if self._phase is not _Phase.IDLE:
            return
        if self.trace is not None:
            self.trace.before_plan()
        plan = self.scheduler.schedule()
        if plan is None:
            return
        if self.trace is not None:
            self.trace.planned(plan)
        self._plan, self._phase = plan, _Phase.ALLOCATING
        self.send("allocator", plan.allocate_message(self.scheduler.config.block_size))

    def _on_granted(self, granted: SlotsGranted) -> None:
        step = self.scheduler.on_slots_granted(self._plan, granted)
        if self.trace is not None:
            self.trace.granted(self._plan, granted, ran=step is not None)
        if step is None:  # nothing runs: the grant only moved blocks
            self._phase, self._plan = _Phase.IDLE, None
            self._kick()
            return
        self._phase, self._running_since = _Phase.RUNNING, self.clock()
        self.num_steps += 1
        if self._plan.on_trial is not None:  # before the step: it may not come back
            self.send("frontend", EngineOutputs(step.step_id, [], on_trial=[self._plan.on_trial]))
        self.send("executor", step)
        if step.structured_request_ids:  # filled while the workers run the forward
            matchers = [self.scheduler.requests[rid].grammar
                        for rid in step.structured_request_ids]
            self.send("executor", GrammarBitmask(step.step_id, step.structured_request_ids,
                                                 fill_bitmask(matchers, self.grammars.vocab_size)))

    def _on_result(self, result: StepResult) -> None:
        if self.trace is not None:
            self.trace.step_result(self._plan, result)
        outputs = self.scheduler.update_from_output(self._plan, result)
        deltas = outputs.deltas + self._apply_deferred()
        self._phase, self._plan = _Phase.IDLE, None
        # free blocks (the next proposal carries them) before the frontend hears of the
        # finish, so a caller woken by its last output never sees its blocks still held
        self._kick()
        self._send_outputs(EngineOutputs(outputs.step_id, deltas,
                                         trial_over=outputs.trial_over))

    def _apply_deferred(self) -> list:
        deltas = []
        for message in self._deferred:
            if isinstance(message, StopRequests):
                deltas += self.scheduler.abort(message.request_ids, RequestEvent.FINISH,
                                               stop_reasons=message.stop_reasons)
            else:
                deltas += self.scheduler.abort(message.request_ids)
        self._deferred = []
        return deltas

    def _send_outputs(self, outputs: EngineOutputs) -> None:
        if outputs.deltas or outputs.trial_over:
            self.send("frontend", outputs)
