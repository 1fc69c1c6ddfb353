"""ExecutorActor: fans each step out to its workers, gathers one StepResult, supervises them.

A worker that raises in a step, or whose thread dies, costs no request: the executor answers
the step with a ``fault`` (nothing of it happened; the scheduler preempts every running request
so that all of them are recomputed) and replaces the worker. The replacement runner is built on
a thread of its own (loading weights takes seconds; the executor keeps answering meanwhile, and
the thread's OpenMP pool leaves with it, see ``openmp``); a step that arrives before it is
ready waits here. A worker lost between steps took the persistent batch with it, so the next
step is answered with a fault too, blaming no request. A runner that cannot be rebuilt fails
the executor, which ends the engine (its supervisor fails every live request).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import pykka

from actorlm.actors.base import EngineActor, tell
from actorlm.actors.worker import WorkerActor
from actorlm.messages import (ExecutorStats, GetStats, GrammarBitmask, ScheduleStep, StepResult,
                              WorkerFailed, WorkerRestarted, WorkerResult)
from actorlm.openmp import on_passing_thread

log = logging.getLogger(__name__)


class ExecutorActor(EngineActor):
    def __init__(self, make_runner: Callable[[int], object], num_workers: int,
                 scheduler: pykka.ActorRef, on_death: Callable[[str], None] | None = None):
        super().__init__(on_death)
        self.make_runner, self.scheduler = make_runner, scheduler
        # Built in the caller's call (a load error raises there), off its thread (see openmp).
        self._runners = [on_passing_thread(make_runner, rank) for rank in range(num_workers)]
        self.workers: list[pykka.ActorRef | None] = [None] * num_workers
        self.generations = [0] * num_workers
        self.num_restarts = 0
        self._step: ScheduleStep | None = None  # with the workers
        self._held: ScheduleStep | None = None  # waiting for a replacement worker
        self._held_bitmask: GrammarBitmask | None = None  # the held step's
        self._results: dict[int, StepResult] = {}
        self._state_lost = False  # a worker was replaced between steps

    def on_start(self):
        for rank, runner in enumerate(self._runners):
            self._start_worker(rank, runner)
        self._runners = []

    def on_stop(self):
        self._stop_planned_workers()
        super().on_stop()

    def on_failure(self, exception_type, exception_value, traceback):
        self._stop_planned_workers()
        super().on_failure(exception_type, exception_value, traceback)

    def on_receive(self, message):
        if isinstance(message, ScheduleStep):
            self._on_step(message)
        elif isinstance(message, GrammarBitmask):
            self._on_bitmask(message)
        elif isinstance(message, WorkerResult):
            self._on_worker_result(message)
        elif isinstance(message, WorkerFailed):
            self._on_worker_failed(message)
        elif isinstance(message, WorkerRestarted):
            self._on_worker_restarted(message)
        elif isinstance(message, GetStats):
            return ExecutorStats(self.num_restarts)
        else:
            raise TypeError(f"ExecutorActor cannot handle {type(message).__name__}")

    # --- steps --------------------------------------------------------------------------------

    def _on_step(self, step: ScheduleStep) -> None:
        if self._state_lost:
            self._state_lost = False
            self._fault(step, "a worker was replaced since the last step", blame=False)
        elif None in self.workers:
            self._held = step
        else:
            self._dispatch(step)

    def _dispatch(self, step: ScheduleStep) -> None:
        self._step, self._results = step, {}
        for worker in self.workers:
            tell(worker, step)  # a worker that is gone reports itself: WorkerFailed

    def _on_bitmask(self, bitmask: GrammarBitmask) -> None:
        if self._step is not None and bitmask.step_id == self._step.step_id:
            for worker in self.workers:
                tell(worker, bitmask)
        elif self._held is not None and bitmask.step_id == self._held.step_id:
            self._held_bitmask = bitmask
        # else: the step faulted already, and will be planned again with a bitmask of its own

    def _on_worker_result(self, message: WorkerResult) -> None:
        if self._step is None or message.result.step_id != self._step.step_id:
            return  # the answer of a step already given up on (a fault on another rank)
        self._results[message.rank] = message.result
        if len(self._results) == len(self.workers):
            # every rank samples identically; rank 0 speaks for the step
            self._step = None
            tell(self.scheduler, self._results[0])

    def _fault(self, step: ScheduleStep, error: str, blame: bool) -> None:
        tell(self.scheduler, StepResult(step.step_id, [], [], fault=error,
                                        blame_request_ids=step.request_ids if blame else []))

    # --- supervision --------------------------------------------------------------------------

    def _on_worker_failed(self, message: WorkerFailed) -> None:
        rank = message.rank
        if message.generation != self.generations[rank]:
            return  # a worker already replaced, saying goodbye
        error = f"worker {rank}: {message.error}"
        step, self._step = self._step, None
        if step is not None:
            log.error("%s; step %d will be recomputed", error, step.step_id)
            self._fault(step, error, blame=True)
        elif self._held is None:  # a held step was planned after a fault: it is all new
            log.error("%s between steps; the next step will be recomputed", error)
            self._state_lost = True
        self._replace(rank)

    def _replace(self, rank: int) -> None:
        self.generations[rank] += 1
        self.num_restarts += 1
        old, self.workers[rank] = self.workers[rank], None
        if old is not None and old.is_alive():
            old.stop(block=False)
        generation, executor = self.generations[rank], self.actor_ref

        def rebuild() -> None:
            try:
                runner = self.make_runner(rank)
            except Exception as exc:  # noqa: BLE001 — reported to the executor, which fails
                error = f"{type(exc).__name__}: {exc}"
                tell(executor, WorkerRestarted(rank, generation, error=error))
            else:
                tell(executor, WorkerRestarted(rank, generation, runner))

        threading.Thread(target=rebuild, name=f"actorlm-restart-{rank}", daemon=True).start()

    def _on_worker_restarted(self, message: WorkerRestarted) -> None:
        if message.generation != self.generations[message.rank]:
            return
        if message.error is not None:
            raise RuntimeError(f"worker {message.rank} could not be restarted: {message.error}")
        log.info("worker %d restarted", message.rank)
        self._start_worker(message.rank, message.runner)
        if self._held is not None and None not in self.workers:
            step, self._held = self._held, None
            bitmask, self._held_bitmask = self._held_bitmask, None
            self._dispatch(step)
            if bitmask is not None:
                self._on_bitmask(bitmask)

    def _start_worker(self, rank: int, runner) -> None:
        self.workers[rank] = WorkerActor.start(rank, self.generations[rank], runner,
                                               self.actor_ref)

    def _stop_planned_workers(self) -> None:
        self.generations = [g + 1 for g in self.generations]  # their goodbyes are expected
        for worker in self.workers:
            if worker is not None and worker.is_alive():
                worker.stop()
