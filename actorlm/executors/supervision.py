"""The executor's supervision of its worker group, as a plain class: it reacts to one message at
a time and says what to do by calling the group it holds and its injected callables,
``send_to_scheduler(message)`` and ``start_group(generation)``. ``ExecutorActor`` wires them to
the scheduler's ref and to a ``GroupStarter``; the tests wire them to lists.

Each step goes to every rank of the group; when every rank has answered, rank 0's result goes to
the scheduler (with tensor parallelism it alone samples) carrying every rank's timings.

A rank that raises in a step, or dies (its thread ends, its process is killed, its Ray actor is
lost), costs no request: the step is answered with a ``fault`` that blames its requests
(nothing of it happened; the scheduler preempts every running request so that all of them are
recomputed) and the whole group is restarted — every rank, since with tensor parallelism the
survivors would hang in a collective waiting for the lost one. The replacement starts
elsewhere (``start_group``; loading weights takes seconds and the executor keeps answering
meanwhile) and comes back as ``WorkerRestarted``; a step that arrives before it waits here,
with its grammar bitmask. A rank lost between steps took the requests' cached state (their
token and block ids) with it, so the next step is answered with a fault too, blaming no
request. A group that cannot be restarted raises, which fails the executor and so ends the
engine (its supervisor fails every live request).

Every group has a generation; a message from a group already given up on (a rank's goodbye, a
result that comes after its step faulted) is ignored.
"""

from __future__ import annotations

import logging
from typing import Callable

import msgspec

from actorlm.messages import (ExecutorStats, GrammarBitmask, ScheduleStep, StepResult,
                              WorkerFailed, WorkerRestarted, WorkerResult)

log = logging.getLogger(__name__)


class WorkerSupervision:
    def __init__(self, group, num_workers: int, reply_to,
                 send_to_scheduler: Callable[[StepResult], None],
                 start_group: Callable[[int], None]):
        self.group = group  # generation 0, started; None while a restarted group starts
        self.num_workers = num_workers
        self.reply_to = reply_to  # where the ranks report (the executor): ``group.attach``'s
        self.send_to_scheduler = send_to_scheduler
        self.start_group = start_group  # its group comes back as WorkerRestarted
        self.generation = 0
        self.num_restarts = 0
        self._step: ScheduleStep | None = None  # with the workers
        self._held: ScheduleStep | None = None  # waiting for a restarted group
        self._held_bitmask: GrammarBitmask | None = None  # the held step's
        self._results: dict[int, StepResult] = {}  # the step's, by rank
        self._state_lost: str | None = None  # why the workers were restarted between steps

    @property
    def workers(self) -> list:
        """The group's ``WorkerActor`` refs (thread workers only; for tests)."""
        return list(getattr(self.group, "workers", [])) if self.group is not None else []

    def attach(self) -> None:
        """Make the group's ranks report to ``reply_to`` (the first group: once the executor
        runs)."""
        self.group.attach(self.reply_to)

    def stats(self) -> ExecutorStats:
        return ExecutorStats(self.num_restarts,
                             list(self.group.pids) if self.group is not None else [])

    def stop(self) -> None:
        """The executor stops: so does the group, after a step in progress."""
        self.generation += 1  # the ranks' goodbyes are expected
        if self.group is not None:
            self.group.stop()

    # --- steps --------------------------------------------------------------------------------

    def on_step(self, step: ScheduleStep) -> None:
        """Dispatch ``step``, hold it for a group still starting, or fault it (the group was
        restarted since the last step)."""
        if self._state_lost is not None:
            error, self._state_lost = self._state_lost, None
            self._fault(step, f"the workers were restarted since the last step: {error}",
                        blame=False)
        elif self.group is None:
            self._held = step
        else:
            self._dispatch(step)

    def on_bitmask(self, bitmask: GrammarBitmask) -> None:
        """Pass a step's bitmask on to the ranks, or keep it with its held step."""
        if self._step is not None and bitmask.step_id == self._step.step_id:
            self.group.send_bitmask(bitmask)
        elif self._held is not None and bitmask.step_id == self._held.step_id:
            self._held_bitmask = bitmask
        # else: the step faulted already, and will be planned again with a bitmask of its own

    def on_worker_result(self, message: WorkerResult) -> None:
        """Gather one rank's result; the last one answers the scheduler."""
        if self._step is None or message.result.step_id != self._step.step_id:
            return  # the answer of a step already given up on (a fault on another rank)
        self._results[message.rank] = message.result
        if len(self._results) == self.num_workers:
            self._step = None
            rank_timings = [self._results[rank].timings for rank in range(self.num_workers)]
            self.send_to_scheduler(msgspec.structs.replace(self._results[0],
                                                           rank_timings=rank_timings))

    def _dispatch(self, step: ScheduleStep) -> None:
        self._step, self._results = step, {}
        self.group.send_step(step)

    def _fault(self, step: ScheduleStep, error: str, blame: bool) -> None:
        self.send_to_scheduler(StepResult(step.step_id, [], [], fault=error,
                                          blame_request_ids=step.request_ids if blame else []))

    # --- supervision --------------------------------------------------------------------------

    def on_worker_failed(self, message: WorkerFailed) -> None:
        """A rank of the current group failed: fault its step (or the next one) and restart."""
        if message.generation != self.generation:
            return  # a rank of a group already stopped, saying goodbye
        error = f"worker {message.rank}: {message.error}"
        step, self._step = self._step, None
        if step is not None:
            log.error("%s; step %d will be recomputed", error, step.step_id)
            self._fault(step, error, blame=True)
        elif self._held is None:  # a held step was planned after a fault: it is all new
            log.error("%s between steps; the next step will be recomputed", error)
            self._state_lost = error
        self._restart()

    def on_restarted(self, message: WorkerRestarted) -> None:
        """Install the restarted group and dispatch the step held for it; stop a stale one.
        Raises if the group could not be restarted."""
        if message.generation != self.generation:
            if message.workers is not None:
                message.workers.stop(kill=True)
            return
        if message.error is not None:
            raise RuntimeError(f"the workers could not be restarted: {message.error}")
        log.info("workers restarted")
        self.group = message.workers
        self.attach()
        if self._held is not None:
            step, self._held = self._held, None
            bitmask, self._held_bitmask = self._held_bitmask, None
            self._dispatch(step)
            if bitmask is not None:
                self.on_bitmask(bitmask)

    def _restart(self) -> None:
        self.generation += 1
        self.num_restarts += 1
        old, self.group = self.group, None
        old.stop(kill=True)
        self.start_group(self.generation)
