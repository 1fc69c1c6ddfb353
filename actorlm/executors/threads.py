"""ThreadWorkerGroup: the workers as ``WorkerActor`` threads in this process
(``--distributed-executor-backend uni``, the default for one rank).

The runners are built on passing threads (their OpenMP pools leave with them, see
``actorlm.openmp``); a load error raises in the caller unchanged. Messages pass as objects:
nothing is encoded.
"""

from __future__ import annotations

from typing import Callable

from actorlm.engine_actor import tell
from actorlm.executors.worker_actor import WorkerActor
from actorlm.messages import GrammarBitmask, ScheduleStep
from actorlm.openmp import on_passing_thread


class ThreadWorkerGroup:
    tensor_parallel = False  # one process holds no shards; every rank samples

    def __init__(self, make_runner: Callable[[int], object], size: int, generation: int):
        self.make_runner, self.size, self.generation = make_runner, size, generation
        self.workers: list = []  # WorkerActor refs, once attached
        self.pids: list[int] = []  # the workers have no processes of their own
        self._runners: list = []

    def start(self) -> None:
        self._runners = [on_passing_thread(self.make_runner, rank) for rank in range(self.size)]

    def attach(self, executor) -> None:
        self.workers[:] = [WorkerActor.start(rank, self.generation, runner, executor)
                           for rank, runner in enumerate(self._runners)]
        self._runners = []

    def send_step(self, step: ScheduleStep) -> None:
        for worker in self.workers:
            tell(worker, step)  # a worker that is gone reports itself: WorkerFailed

    def send_bitmask(self, bitmask: GrammarBitmask) -> None:
        for worker in self.workers:
            tell(worker, bitmask)

    def stop(self, kill: bool = False) -> None:
        """Stop every worker; ``kill``: without waiting for a step in progress (a thread cannot
        be killed; its result is then ignored)."""
        self._runners = []
        for worker in self.workers:
            if worker.is_alive():
                worker.stop(block=not kill)
