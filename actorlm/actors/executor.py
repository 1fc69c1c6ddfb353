"""ExecutorActor: fans each step out to its workers, gathers one StepResult, supervises them.

The workers are a group (``actorlm.executors``): threads in this process, a process per rank,
or a Ray actor per rank. Supervision is the same for all. A rank that raises in a step, or dies
(its thread ends, its process is killed, its Ray actor is lost), costs no request: the executor
answers the step with a ``fault`` (nothing of it happened; the scheduler preempts every running
request so that all of them are recomputed) and restarts the whole group — every rank, since
with tensor parallelism the survivors would hang in a collective waiting for the lost one. The
new group starts on a thread of its own (loading weights takes seconds; the executor keeps
answering meanwhile, and for threads the loading thread's OpenMP pool leaves with it, see
``openmp``); a step that arrives before it is ready waits here. A rank lost between steps took
the persistent batch with it, so the next step is answered with a fault too, blaming no request.
A group that cannot be restarted fails the executor, which ends the engine (its supervisor
fails every live request).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Callable

import msgspec
import pykka

from actorlm.actors.base import EngineActor, tell
from actorlm.executors import make_worker_group
from actorlm.messages import (ExecutorStats, GetStats, GrammarBitmask, ScheduleStep, StepResult,
                              WorkerFailed, WorkerRestarted, WorkerResult)

log = logging.getLogger(__name__)


class ExecutorActor(EngineActor):
    def __init__(self, make_runner: Callable[[int], object], num_workers: int,
                 scheduler: pykka.ActorRef, on_death: Callable[[str], None] | None = None,
                 backend: str = "uni", tensor_parallel: bool = False):
        super().__init__(on_death)
        self.scheduler, self.num_workers = scheduler, num_workers
        self._new_group = functools.partial(make_worker_group, backend, make_runner,
                                            num_workers, tensor_parallel)
        self.generation = 0
        # Started in the caller's call: a load error raises there, with nothing left running.
        self.group = self._new_group(self.generation)
        self.group.start()
        self.workers: list = []  # the group's WorkerActor refs (threads only; for tests)
        self.num_restarts = 0
        self._step: ScheduleStep | None = None  # with the workers
        self._held: ScheduleStep | None = None  # waiting for a restarted group
        self._held_bitmask: GrammarBitmask | None = None  # the held step's
        self._results: dict[int, StepResult] = {}
        self._state_lost: str | None = None  # why the workers were restarted between steps
        # a group started by a restart thread, until this actor owns it (see _restart)
        self._lock = threading.Lock()
        self._stopped = False
        self._starting = None

    def on_start(self):
        self._install(self.group)

    def on_stop(self):
        self._stop_workers()
        super().on_stop()

    def on_failure(self, exception_type, exception_value, traceback):
        self._stop_workers()
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
            self._on_workers_restarted(message)
        elif isinstance(message, GetStats):
            return ExecutorStats(self.num_restarts,
                                 list(self.group.pids) if self.group is not None else [])
        else:
            raise TypeError(f"ExecutorActor cannot handle {type(message).__name__}")

    # --- steps --------------------------------------------------------------------------------

    def _on_step(self, step: ScheduleStep) -> None:
        if self._state_lost is not None:
            error, self._state_lost = self._state_lost, None
            self._fault(step, f"the workers were restarted since the last step: {error}",
                        blame=False)
        elif self.group is None:
            self._held = step
        else:
            self._dispatch(step)

    def _dispatch(self, step: ScheduleStep) -> None:
        self._step, self._results = step, {}
        self.group.send_step(step)

    def _on_bitmask(self, bitmask: GrammarBitmask) -> None:
        if self._step is not None and bitmask.step_id == self._step.step_id:
            self.group.send_bitmask(bitmask)
        elif self._held is not None and bitmask.step_id == self._held.step_id:
            self._held_bitmask = bitmask
        # else: the step faulted already, and will be planned again with a bitmask of its own

    def _on_worker_result(self, message: WorkerResult) -> None:
        if self._step is None or message.result.step_id != self._step.step_id:
            return  # the answer of a step already given up on (a fault on another rank)
        self._results[message.rank] = message.result
        if len(self._results) == self.num_workers:
            # rank 0 speaks for the step (with tensor parallelism it alone samples); every
            # rank's timings travel with it
            self._step = None
            rank_timings = [self._results[rank].timings for rank in range(self.num_workers)]
            tell(self.scheduler, msgspec.structs.replace(self._results[0],
                                                         rank_timings=rank_timings))

    def _fault(self, step: ScheduleStep, error: str, blame: bool) -> None:
        tell(self.scheduler, StepResult(step.step_id, [], [], fault=error,
                                        blame_request_ids=step.request_ids if blame else []))

    # --- supervision --------------------------------------------------------------------------

    def _on_worker_failed(self, message: WorkerFailed) -> None:
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

    def _restart(self) -> None:
        self.generation += 1
        self.num_restarts += 1
        old, self.group, self.workers = self.group, None, []
        old.stop(kill=True)
        generation, executor, new_group = self.generation, self.actor_ref, self._new_group

        def rebuild() -> None:
            group = new_group(generation)
            try:
                group.start()
            except Exception as exc:  # noqa: BLE001 — reported to the executor, which fails
                tell(executor, WorkerRestarted(generation, error=f"{type(exc).__name__}: {exc}"))
                return
            with self._lock:  # an executor stopping now will not read its inbox again
                if not self._stopped:
                    self._starting = group
                    tell(executor, WorkerRestarted(generation, group))
                    return
            group.stop(kill=True)

        threading.Thread(target=rebuild, name="actorlm-restart", daemon=True).start()

    def _on_workers_restarted(self, message: WorkerRestarted) -> None:
        with self._lock:
            self._starting = None
        if message.generation != self.generation:
            if message.workers is not None:
                message.workers.stop(kill=True)
            return
        if message.error is not None:
            raise RuntimeError(f"the workers could not be restarted: {message.error}")
        log.info("workers restarted")
        self._install(message.workers)
        if self._held is not None:
            step, self._held = self._held, None
            bitmask, self._held_bitmask = self._held_bitmask, None
            self._dispatch(step)
            if bitmask is not None:
                self._on_bitmask(bitmask)

    def _install(self, group) -> None:
        self.group = group
        group.attach(self.actor_ref)
        self.workers = list(getattr(group, "workers", []))

    def _stop_workers(self) -> None:
        self.generation += 1  # the ranks' goodbyes are expected
        with self._lock:
            self._stopped = True
            starting, self._starting = self._starting, None
        for group in (self.group, starting):
            if group is not None:
                group.stop()
