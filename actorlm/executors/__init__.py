"""Worker groups: the ranks an ``ExecutorActor`` drives, however they run.

- ``threads.ThreadWorkerGroup`` (``uni``): ``WorkerActor`` threads (``worker_actor``) in this
  process.
- ``processes.ProcessWorkerGroup`` (``mp``): a process per rank (``process_main``).
- ``ray_group.RayWorkerGroup`` (``ray``): a Ray actor per rank, in a placement group.

Every group has the same small surface, so the executor supervises them alike:
``start()`` builds every rank's runner and blocks until they are ready (a load error raises in
the caller); ``attach(executor)`` makes the ranks report to the executor (``WorkerResult``,
``WorkerFailed`` with the group's ``generation``); ``send_step`` / ``send_bitmask``; ``stop(kill)``;
``pids`` (the ranks' processes, empty for threads); ``tensor_parallel`` (only rank 0 samples).
The process and Ray ranks share ``worker_loop`` and the msgpack ``wire``.

How the executor supervises a group — dispatch, fault, hold, restart — is a plain class,
``supervision.WorkerSupervision``; ``group_starter.GroupStarter`` starts a replacement group on
a thread of its own. Nothing here imports the engine actors (``actors/``): they import this.
"""

from __future__ import annotations

from typing import Callable

from actorlm.config import EXECUTOR_BACKENDS


def make_worker_group(backend: str, make_runner: Callable[[int], object], size: int,
                      tensor_parallel: bool, generation: int):
    """A group of ``size`` ranks for ``--distributed-executor-backend`` ``backend``, not started.
    ``make_runner`` must be picklable (a ``RunnerFactory``) for ``mp`` and ``ray``."""
    if backend == "uni":
        from actorlm.executors.threads import ThreadWorkerGroup

        return ThreadWorkerGroup(make_runner, size, generation)
    if backend == "mp":
        from actorlm.executors.processes import ProcessWorkerGroup

        return ProcessWorkerGroup(make_runner, size, generation, tensor_parallel)
    if backend == "ray":
        from actorlm.executors.ray_group import RayWorkerGroup

        return RayWorkerGroup(make_runner, size, generation, tensor_parallel)
    raise ValueError(f"--distributed-executor-backend must be one of "
                     f"{', '.join(EXECUTOR_BACKENDS)}; got {backend!r}")
