"""ExecutorActor: fans each step out to its workers and gathers one StepResult.

It owns the workers: it starts them, stops them, and supervises them — a worker that dies
fails the step it was running (only that step's requests) and is started again.
"""

from __future__ import annotations

import logging
from typing import Callable

import pykka

from actorlm.actors.base import tell
from actorlm.actors.worker import WorkerActor
from actorlm.messages import ScheduleStep, StepResult, WorkerResult
from actorlm.openmp import on_passing_thread

log = logging.getLogger(__name__)


class ExecutorActor(pykka.ThreadingActor):
    def __init__(self, make_runner: Callable[[int], object], num_workers: int,
                 scheduler: pykka.ActorRef):
        super().__init__()
        self.make_runner, self.scheduler = make_runner, scheduler
        # Built in the caller's call (a load error raises there), off its thread (see openmp).
        self.runners = [on_passing_thread(make_runner, rank) for rank in range(num_workers)]
        self.workers: list[pykka.ActorRef] = []
        self._step: ScheduleStep | None = None
        self._results: dict[int, StepResult] = {}

    def on_start(self):
        self.workers = [WorkerActor.start(rank, runner, self.actor_ref)
                        for rank, runner in enumerate(self.runners)]

    def on_stop(self):
        for worker in self.workers:
            worker.stop()

    def on_receive(self, message):
        if isinstance(message, ScheduleStep):
            self._step, self._results = message, {}
            for rank, worker in enumerate(self.workers):
                try:
                    worker.tell(message)
                except pykka.ActorDeadError:
                    self._on_worker_died(rank)
                    return
        elif isinstance(message, WorkerResult):
            self._results[message.rank] = message.result
            if len(self._results) == len(self.workers):
                # every rank samples identically; rank 0 speaks for the step
                self._step = None
                tell(self.scheduler, self._results[0])
        else:
            raise TypeError(f"ExecutorActor cannot handle {type(message).__name__}")

    def _on_worker_died(self, rank: int) -> None:
        step, self._step = self._step, None
        log.error("worker %d is dead; failing step %d and restarting it", rank, step.step_id)
        tell(self.scheduler, StepResult(step.step_id, [], [], f"worker {rank} died",
                                        step.request_ids))
        self.runners[rank] = on_passing_thread(self.make_runner, rank)
        self.workers[rank] = WorkerActor.start(rank, self.runners[rank], self.actor_ref)
