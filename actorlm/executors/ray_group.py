"""RayWorkerGroup: a Ray actor per rank (``--distributed-executor-backend ray``).

The ranks are ``RayWorker`` actors, one per bundle of a placement group (``{"CPU": 1}`` each),
running the same ``WorkerLoop`` as a worker process and speaking the same msgpack ``wire``. A
step is encoded once (and put in Ray's object store once when there are several ranks). A
thread per rank waits on each call's result with ``ray.get`` and turns it into ``WorkerResult``;
a dead actor (``ray.kill``, its node lost: ``RayActorError``) into ``WorkerFailed``, and the
executor restarts every rank. A call that never returns, in a concurrency group of its own,
tells of a rank that dies between steps.

Ray is an optional extra (``pip install 'actorlm[ray]'``), imported only here. The engine joins
the cluster at ``RAY_ADDRESS`` or the one this process already joined, else starts a small
local one. The actors get this actorlm on their ``PYTHONPATH``: they import the driver's code.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from pathlib import Path

from actorlm.engine_actor import tell
from actorlm.executors.processes import free_port
from actorlm.executors.wire import WireCodec, WorkerReply
from actorlm.executors.worker_loop import (WorkerLoop, build_runner, load_error_from,
                                           load_failure)
from actorlm.messages import GrammarBitmask, ScheduleStep, WorkerFailed, WorkerResult

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 60.0


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("--distributed-executor-backend ray needs Ray: "
                          "pip install 'actorlm[ray]'") from None
    return ray


def ensure_ray(ray, num_cpus: int) -> None:
    """Join a Ray cluster: the one this process is in, ``RAY_ADDRESS``'s, or a local one."""
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    else:
        ray.init(num_cpus=max(num_cpus, os.cpu_count() or 1), include_dashboard=False,
                 log_to_driver=False)


class RayWorker:
    """One rank inside its Ray actor; methods are called in order, one at a time."""

    def __init__(self, rank: int):
        self.rank, self.codec, self.loop = rank, WireCodec(), None

    def rendezvous(self) -> str:
        """Rank 0's address for torch.distributed: where the ranks meet is its node."""
        import ray

        host = ray.util.get_node_ip_address()
        return f"tcp://{host}:{free_port(host)}"

    def load(self, factory, size: int, init_method: str, tensor_parallel: bool) -> bytes:
        try:
            runner = build_runner(factory, self.rank, size, init_method, tensor_parallel)
        except BaseException as exc:  # noqa: BLE001 — the caller raises it
            return load_failure(self.codec, exc)
        self.loop = WorkerLoop(runner, self.rank)
        return self.codec.encode_reply(WorkerReply(pid=os.getpid()))

    def handle(self, data: bytes) -> bytes:
        return self.loop.handle(data)

    def until_killed(self) -> None:
        """Never returns: the call fails when the actor dies, which tells the driver of a death
        between steps (called in a concurrency group of its own, beside the steps)."""
        threading.Event().wait()


def rank_bundle(factory) -> dict[str, float]:
    """What one rank asks of the cluster: a CPU, and the GPU it runs on when the model runs
    on GPUs (Ray then shows its actor that GPU alone)."""
    on_gpu = str(getattr(factory, "device", "cpu")).startswith("cuda")
    return {"CPU": 1, "GPU": 1} if on_gpu else {"CPU": 1}


def _spelled(resources: dict, kinds: dict | None = None) -> str:
    """``{"CPU": 1, "GPU": 1}`` as ``1 CPU and 1 GPU`` (of the kinds in ``kinds``, if given)."""
    return " and ".join(f"{resources.get(kind, 0):g} {kind}" for kind in (kinds or resources))


class RayWorkerGroup:
    def __init__(self, factory, size: int, generation: int, tensor_parallel: bool):
        self.factory, self.size, self.generation = factory, size, generation
        self.tensor_parallel = tensor_parallel
        self.codec = WireCodec()
        self.pids: list[int] = []
        self._ray = import_ray()
        self.actors: list = []  # the ranks' Ray actor handles
        self._placement = None
        self._calls: list[queue.Queue] = [queue.Queue() for _ in range(size)]
        self._stopping = False

    def start(self) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ensure_ray(ray, self.size)
        bundle = rank_bundle(self.factory)
        try:
            self._placement = placement_group([bundle] * self.size)
            try:
                ray.get(self._placement.ready(), timeout=PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                free = ray.available_resources()
                raise RuntimeError(f"the Ray cluster has no room for {self.size} workers of "
                                   f"{_spelled(bundle)} each (--tensor-parallel-size "
                                   f"{self.size}); it has {_spelled(free, bundle)} free") \
                    from None
            actor_class = ray.remote(concurrency_groups={"watch": 1})(RayWorker)
            env = {"PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
            self.actors = [actor_class.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement, placement_group_bundle_index=rank)).remote(rank)
                for rank in range(self.size)]
            init_method = ray.get(self.actors[0].rendezvous.remote())
            replies = ray.get([actor.load.remote(self.factory, self.size, init_method,
                                                 self.tensor_parallel)
                               for actor in self.actors])
            for rank, data in enumerate(replies):
                reply = self.codec.decode_reply(data)
                if reply.load_error is not None:
                    raise load_error_from(reply, f"Ray worker {rank}")
                self.pids.append(reply.pid)
        except BaseException:
            self.stop(kill=True)
            raise
        log.info("Ray workers started: pids %s", self.pids)

    def attach(self, executor) -> None:
        for rank in range(self.size):
            threading.Thread(target=self._read, args=(rank, executor), daemon=True,
                             name=f"actorlm-ray-worker-{rank}").start()
        threading.Thread(target=self._watch, args=(executor,), daemon=True,
                         name="actorlm-ray-watch").start()

    def _watch(self, executor) -> None:
        """Report a rank that dies while no step is in flight (a step's call reports its own)."""
        ray = self._ray
        watches = [actor.until_killed.options(concurrency_group="watch").remote()
                   for actor in self.actors]
        try:
            ready, _ = ray.wait(watches, num_returns=1)
            if self._is_connected():
                ray.get(ready[0])
        except ray.exceptions.RayError as exc:
            self._report(executor, watches.index(ready[0]),
                         f"its Ray actor died ({type(exc).__name__})")
        except Exception:  # noqa: BLE001 — the session ended under us (ray.shutdown at exit)
            pass

    def _is_connected(self) -> bool:
        """Whether this process is still in the Ray session. After ``ray.shutdown()`` (Ray's
        own exit hook may run before the engine's) a ``ray.get`` would start a new cluster."""
        return self._ray.is_initialized()

    def _read(self, rank: int, executor) -> None:
        ray, codec, calls = self._ray, WireCodec(), self._calls[rank]
        while (call := calls.get()) is not None and self._is_connected():
            try:
                data = ray.get(call)
            except ray.exceptions.RayActorError as exc:
                return self._report(executor, rank, f"its Ray actor died ({type(exc).__name__})")
            except ray.exceptions.RayError as exc:
                return self._report(executor, rank, f"{type(exc).__name__}: {exc}")
            except Exception as exc:  # noqa: BLE001 — the session ended under us
                return self._report(executor, rank, f"the Ray session ended ({exc})")
            if not data:
                continue
            reply = codec.decode_reply(data)
            if reply.fault is not None:
                return self._report(executor, rank, reply.fault)
            tell(executor, WorkerResult(rank, reply.result))

    def _report(self, executor, rank: int, error: str) -> None:
        if not self._stopping:
            tell(executor, WorkerFailed(rank, self.generation, error))

    def send_step(self, step: ScheduleStep) -> None:
        if not self._is_connected():
            return  # the session ended (the readers have said so); a put would start a new one
        data = self.codec.encode_step(step)  # one encoding (and one object) for every rank
        self._call(self.actors, self._ray.put(data) if self.size > 1 else data)

    def send_bitmask(self, bitmask: GrammarBitmask) -> None:
        self._call(self.actors[:1] if self.tensor_parallel else self.actors,
                   self.codec.encode_bitmask(bitmask))

    def _call(self, actors: list, arg) -> None:
        if not self._is_connected():
            return
        for rank, actor in enumerate(actors):
            self._calls[rank].put(actor.handle.remote(arg))

    def stop(self, kill: bool = False) -> None:
        """Kill every rank's actor (a Ray actor holds nothing to flush) and free the bundles."""
        self._stopping = True
        for calls in self._calls:
            calls.put(None)
        if not self._is_connected():
            return  # the session's end took the actors and their bundles with it
        for actor in self.actors:
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 — gone already
                pass
        if self._placement is not None:
            try:
                self._ray.util.remove_placement_group(self._placement)
            except Exception:  # noqa: BLE001 — the cluster went first
                pass
            self._placement = None
