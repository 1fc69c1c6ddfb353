"""RayCore: an engine core run by a Ray actor (``--data-parallel-backend ray``).

Ray places each replica's actor on the cluster (``RAY_ADDRESS``'s, or a local one), spread
over its nodes; the actor runs ``core_main.run`` in its own process, which connects over TCP
to the sockets the frontend bound. To the client it has the face of the ``Popen`` it polls:
``poll()`` is None while ``run`` runs, ``kill()`` is ``ray.kill``, and Ray ends the actor
when the frontend's process ends (it owns the actor): once Ray has shut down, the core is
never seen to die, so no one restarts it.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from actorlm.executors.ray_group import ensure_ray, import_ray


class CoreActor:
    """Inside the Ray actor. Two calls at a time: ``pid`` is answered while ``run`` runs."""

    def pid(self) -> int:
        return os.getpid()

    def run(self, spec_bytes: bytes) -> int:
        from actorlm.engine_core.core_main import run
        from actorlm.engine_core.wire import decode_spec

        run(decode_spec(spec_bytes))
        return 0


def node_address() -> str:
    """This node's address, as the cluster's other nodes reach it."""
    ray = import_ray()
    ensure_ray(ray, 1)
    return ray.util.get_node_ip_address()


class RayCore:
    def __init__(self, spec_bytes: bytes, num_cpus: int):
        self._ray = ray = import_ray()
        ensure_ray(ray, num_cpus)
        env = {"PYTHONPATH": os.pathsep.join(
            [str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])}
        actor_class = ray.remote(max_concurrency=2)(CoreActor)
        self._actor = actor_class.options(num_cpus=num_cpus, max_restarts=0,
                                          scheduling_strategy="SPREAD",
                                          runtime_env={"env_vars": env}).remote()
        self.pid = ray.get(self._actor.pid.remote())
        self._run = self._actor.run.remote(spec_bytes)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self._cluster_closed():
            return None  # not a death to restart from: this process is exiting
        if self.returncode is None and self._ray.wait([self._run], timeout=0)[0]:
            try:
                self.returncode = self._ray.get(self._run)
            except self._ray.exceptions.RayActorError:  # killed, or its node lost
                self.returncode = -signal.SIGKILL
            self._ray.kill(self._actor, no_restart=True)  # its CPUs go back to the cluster
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self._cluster_closed():
            return -signal.SIGKILL  # the actor ended with the cluster
        if self.poll() is None and not self._ray.wait([self._run], timeout=timeout)[0]:
            raise subprocess.TimeoutExpired("engine core (Ray actor)", timeout)
        return self.poll()

    def kill(self) -> None:
        if self.poll() is None and not self._cluster_closed():
            self._ray.kill(self._actor, no_restart=True)

    def _cluster_closed(self) -> bool:
        """Ray has shut down (its exit hook runs before the engine's finalizers): asking it
        anything now would start a fresh cluster."""
        return not self._ray.is_initialized()
