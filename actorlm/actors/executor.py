"""ExecutorActor: fans each step out to its workers, gathers one StepResult, supervises them.

A thin shell. The workers are a group (``actorlm.executors``): threads in this process, a
process per rank, or a Ray actor per rank; supervision is the same for all and lives in
``executors/supervision.py`` (``WorkerSupervision``: dispatch, fault, hold, restart). The actor
wires its ``send_to_scheduler`` to the scheduler's ref and its ``start_group`` to a
``GroupStarter``, whose loading thread hands the new group back here as ``WorkerRestarted``.
A group that cannot be restarted fails the executor, which ends the engine.
"""

from __future__ import annotations

import functools
from typing import Callable

import pykka

from actorlm.engine_actor import EngineActor, tell
from actorlm.executors import make_worker_group
from actorlm.executors.group_starter import GroupStarter
from actorlm.executors.supervision import WorkerSupervision
from actorlm.messages import (GetStats, GrammarBitmask, ScheduleStep, WorkerFailed,
                              WorkerRestarted, WorkerResult)


class ExecutorActor(EngineActor):
    def __init__(self, make_runner: Callable[[int], object], num_workers: int,
                 scheduler: pykka.ActorRef, on_death: Callable[[str], None] | None = None,
                 backend: str = "uni", tensor_parallel: bool = False):
        super().__init__(on_death)
        self.scheduler, self.num_workers = scheduler, num_workers
        new_group = functools.partial(make_worker_group, backend, make_runner, num_workers,
                                      tensor_parallel)
        # Started in the caller's call: a load error raises there, with nothing left running.
        group = new_group(0)
        group.start()
        self._starter = GroupStarter(new_group, functools.partial(tell, self.actor_ref))
        self.supervision = WorkerSupervision(group, num_workers, self.actor_ref,
                                             functools.partial(tell, scheduler),
                                             self._starter.start)

    @property
    def group(self):
        """The worker group; None while a restarted one starts."""
        return self.supervision.group

    @property
    def workers(self) -> list:
        """The group's ``WorkerActor`` refs (thread workers only; for tests)."""
        return self.supervision.workers

    @property
    def num_restarts(self) -> int:
        return self.supervision.num_restarts

    def on_start(self):
        self.supervision.attach()

    def on_stop(self):
        self._stop_workers()
        super().on_stop()

    def on_failure(self, exception_type, exception_value, traceback):
        self._stop_workers()
        super().on_failure(exception_type, exception_value, traceback)

    def on_receive(self, message):
        if isinstance(message, ScheduleStep):
            self.supervision.on_step(message)
        elif isinstance(message, GrammarBitmask):
            self.supervision.on_bitmask(message)
        elif isinstance(message, WorkerResult):
            self.supervision.on_worker_result(message)
        elif isinstance(message, WorkerFailed):
            self.supervision.on_worker_failed(message)
        elif isinstance(message, WorkerRestarted):
            self._starter.claim()
            self.supervision.on_restarted(message)
        elif isinstance(message, GetStats):
            return self.supervision.stats()
        else:
            raise TypeError(f"ExecutorActor cannot handle {type(message).__name__}")

    def _stop_workers(self) -> None:
        self._starter.close()
        self.supervision.stop()
