"""EngineCoreClient: the frontend's side of one engine-core process.

It binds the two sockets (``ipc://`` in a private directory; TCP on this node's address when
Ray places the core, ``ray_core``), starts the core (``core_main``; a data-parallel replica
on its share of the CPUs) and waits for it to load (or, if ``cancel_load`` is set meanwhile,
kills it and raises ``LoadCancelled``). It then stands in for the scheduler
(behind the ``ReplicaRouter``): it sends on the ``AddRequest``, ``AbortRequests`` and
``StopRequests`` it is told; a reader thread receives each step's ``EngineOutputs`` and
passes them on towards the FrontendActor, feeds the core's trace records to the frontend's
recorder, keeps the core's latest heartbeat (its load, for the balancer) and answers the
queries (``ask``) that wait on it.

When the core dies (``kill -9``, a crash) the reader sees it (the process has ended, checked
every poll), and when it hangs (``HANG_S`` without a word, heartbeats included), or its
heartbeat says a step has run longer than ``STEP_HANG_S`` (a worker stuck in a kernel: the
scheduler still answers, the step never does), the reader kills it; either way it restarts it: what the frontend sends meanwhile is held; the outputs
the dead core still sent are delivered; then the new core gets its live requests back from
the FrontendActor (``ResumeRequests``: the prompt and the tokens streamed so far, recomputed
as after a preemption), and what was held follows. Outputs are stamped with their core's
generation, so nothing the dead one sent late reaches a stream twice. A core that cannot be
restarted ends the engine (``on_dead``).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future

import pykka
import zmq

from actorlm.config import EngineConfig
from actorlm.engine_core.wire import Answer, CoreCodec, CoreInput, CoreReady, CoreSpec
from actorlm.executors.processes import exit_status
from actorlm.executors.worker_loop import load_error_from
from actorlm.messages import (AbortRequests, AddRequest, ResumeRequests, SchedulerStats,
                              StopRequests)

log = logging.getLogger(__name__)

_BOOT = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
         "from actorlm.engine_core.core_main import main; main()")
POLL_MS = 100  # the reader checks that the core still runs at least this often
ASK_TIMEOUT_S = 30.0
DRAIN_S = 0.2  # after a death: how long the dead core's last outputs may take to arrive
HANG_S = 30.0  # a core silent this long (no output, no heartbeat) hangs, and is killed
# a step running this long hangs (vLLM's variable and default: a step, not a heartbeat, is late)
STEP_HANG_S = float(os.environ.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", 300))
STOP_GRACE_S = 5.0


class EngineCoreDied(RuntimeError):
    """The engine core died, and could not be restarted, while a query waited for it."""


class LoadCancelled(RuntimeError):
    """The engine was asked to stop while its core was still loading the model."""


class EngineCoreClient:
    def __init__(self, config: EngineConfig, *, trace=None, index: int = 0,
                 cancel_load: threading.Event | None = None):
        self.config, self.trace, self.index = config, trace, index
        self.cancel_load = cancel_load  # set while loading: the core is killed, start() raises
        self.num_restarts = 0
        self.ready: CoreReady | None = None
        self.last_heartbeat: SchedulerStats | None = None  # the core's latest, with its load
        self._ray = config.data_parallel_backend == "ray"
        self._context = zmq.Context()
        self._dir = tempfile.mkdtemp(prefix="actorlm-core-")
        self._inputs = self._context.socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.SNDHWM, 0)  # never full: a send fails only with no core
        self._outputs = self._context.socket(zmq.PULL)
        self._addresses = [_bind(socket, self._ray, f"{self._dir}/{name}")
                           for socket, name in ((self._inputs, "in"), (self._outputs, "out"))]
        self._codec = CoreCodec()  # the senders', under the lock
        self._lock = threading.Lock()
        self._held: list[CoreInput] | None = None  # while no core takes messages
        self._asks: dict[int, tuple[str, Future]] = {}  # waiting for their answers
        self._ask_ids = itertools.count(1)
        self._proc: subprocess.Popen | None = None
        self._generation = 0
        self._frontend = self._on_dead = None
        self._reader: threading.Thread | None = None
        self._stopping = False

    # --- starting ----------------------------------------------------------------------------

    def start(self) -> CoreReady:
        """Start the core and wait until it has loaded; raises its load error."""
        self.ready = self._spawn()
        return self.ready

    def attach(self, frontend, on_dead) -> None:
        """Relay the core's outputs to ``frontend`` (the FrontendActor's ref) from now on;
        ``on_dead(reason)`` when the core has died and could not be restarted."""
        self._frontend, self._on_dead = frontend, on_dead
        self._reader = threading.Thread(target=self._read, name="actorlm-core-reader",
                                        daemon=True)
        self._reader.start()

    def _spawn(self) -> CoreReady:
        cpus = [] if self._ray else replica_cpus(self.index, self.config.data_parallel_size)
        spec = CoreSpec(self.config, *self._addresses, os.getpid(),
                        logging.getLogger().getEffectiveLevel(), self.index,
                        self.trace is not None, self._generation, cpus=cpus)
        if self._ray:
            from actorlm.engine_core.ray_core import RayCore

            share = max(1, (os.cpu_count() or 1) // self.config.data_parallel_size)
            self._proc = RayCore(self._codec.encode(spec), share)
        else:
            self._proc = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(sys.path)],
                                          stdin=subprocess.PIPE, env=_threads_env(cpus,
                                          self.config.tensor_parallel_size))
            self._proc.stdin.write(self._codec.encode(spec))
            self._proc.stdin.close()
        codec = CoreCodec()
        while True:  # the first word is ready or why not; loading may take minutes
            if self._outputs.poll(POLL_MS):
                output = codec.decode_output(self._outputs.recv())
                if output.generation != self._generation:
                    continue  # a dead core's last words, late
                if output.load_failure is not None:
                    self._proc.wait()
                    raise load_error_from(output.load_failure, self.name)
                if output.ready is not None:
                    self._ingest_trace(output.trace)
                    return output.ready
            elif self._proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self._proc.returncode} "
                                   f"while loading the model")
            if self.cancel_load is not None and self.cancel_load.is_set():
                self._proc.kill()  # a large model would hold the shutdown for minutes
                self._proc.wait()
                raise LoadCancelled(f"{self.name} was stopped while loading the model")

    # --- the scheduler, as the FrontendActor sees it -------------------------------------------

    def tell(self, message) -> None:
        if isinstance(message, AddRequest):
            self._send(CoreInput(add=[message]))
        elif isinstance(message, AbortRequests):
            self._send(CoreInput(abort=message))
        elif isinstance(message, StopRequests):
            self._send(CoreInput(stop=message))
        else:
            raise TypeError(f"an engine core does not take {type(message).__name__}")

    def ask(self, query: str, timeout: float = ASK_TIMEOUT_S) -> Answer:
        """One of ``wire.QUERIES``, answered by the core's actors (blocking)."""
        future: Future = Future()
        ask_id = next(self._ask_ids)
        self._asks[ask_id] = (query, future)
        try:
            self._send(CoreInput(ask=query, ask_id=ask_id))
            answer = future.result(timeout)
        finally:
            self._asks.pop(ask_id, None)
        if answer.error is not None:
            raise RuntimeError(f"{self.name} could not answer {query}: {answer.error}")
        return answer

    @property
    def name(self) -> str:
        """How logs and errors call this core: a replica by its index."""
        return f"engine core {self.index}" if self.config.data_parallel_size > 1 else \
            "the engine core"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def _send(self, message: CoreInput) -> None:
        with self._lock:
            if self._held is None:
                try:
                    self._inputs.send(self._codec.encode(message), zmq.NOBLOCK)
                    return
                except zmq.Again:  # no core connected: it has died, and the reader will see
                    self._held = []
            self._held.append(message)

    # --- the reader ----------------------------------------------------------------------------

    def _read(self) -> None:
        codec = CoreCodec()
        heard = time.monotonic()
        while not self._stopping:
            if self._outputs.poll(POLL_MS):
                self._deliver(codec.decode_output(self._outputs.recv()))
                heard = time.monotonic()
            elif self._proc.poll() is not None and not self._stopping:
                if not self._restart(codec):
                    return
                heard = time.monotonic()
            elif time.monotonic() - heard > HANG_S:  # its heartbeat has stopped: it hangs
                self._kill(f"has not been heard from for {time.monotonic() - heard:.0f} s")

    def _kill(self, why: str) -> None:
        log.error("%s %s; killing it", self.name, why)
        self._proc.kill()
        self._proc.wait()  # (the reader's next poll sees it dead, and restarts it)

    def _deliver(self, output) -> None:
        if output.generation != self._generation:
            return  # a dead core's late words: its requests have been resumed elsewhere
        if output.heartbeat is not None:
            self.last_heartbeat = output.heartbeat
            if output.heartbeat.step_running_s > STEP_HANG_S:
                self._kill(f"has run one step for {output.heartbeat.step_running_s:.0f} s "
                           f"(VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS: {STEP_HANG_S:.0f})")
        self._ingest_trace(output.trace)
        if output.outputs is not None:
            self._frontend.tell(output.outputs)
        if output.answer is not None:
            _, future = self._asks.get(output.answer.ask_id, (None, None))
            if future is not None and not future.done():
                future.set_result(output.answer)

    def _ingest_trace(self, records) -> None:
        if records and self.trace is not None:
            self.trace.ingest(records)

    def _restart(self, codec: CoreCodec) -> bool:
        """The core has died: hold what the frontend sends, deliver its last outputs, start a
        new one and resume the live requests there. False: it could not be restarted."""
        with self._lock:
            if self._held is None:
                self._held = []
        reason = exit_status(self._proc)
        while self._outputs.poll(int(DRAIN_S * 1000)):
            self._deliver(codec.decode_output(self._outputs.recv()))
        self._generation += 1
        self.num_restarts += 1
        log.error("%s %s; restarting it (restart %d)", self.name, reason, self.num_restarts)
        try:
            self.ready = self._spawn()
        except Exception as exc:  # noqa: BLE001 — the engine ends with this reason
            log.error("%s could not be restarted: %s", self.name, exc)
            for _, future in list(self._asks.values()):
                future.set_exception(EngineCoreDied(f"{self.name} {reason}"))
            self._on_dead(f"{self.name} {reason} and could not be restarted: {exc}")
            return False
        try:
            resumed = self._frontend.ask(ResumeRequests())
        except pykka.ActorDeadError:  # the frontend has stopped: the engine is shutting down
            return False
        with self._lock:
            held, self._held = self._held, None
            taken = set(resumed.request_ids)
            self._inputs.send(self._codec.encode(CoreInput(add=resumed.requests)))
            for message in held:  # (a request the frontend resumed was held as well)
                add = [a for a in message.add if a.request_id not in taken]
                if add or message.abort or message.stop:
                    self._inputs.send(self._codec.encode(CoreInput(add, message.abort,
                                                                   message.stop)))
            for ask_id, (query, _) in list(self._asks.items()):  # the dead core's, and held
                self._inputs.send(self._codec.encode(CoreInput(ask=query, ask_id=ask_id)))
        log.info("%s is back (pid %d); %d request(s) resumed", self.name, self._proc.pid,
                 len(resumed.requests))
        return True

    # --- stopping ------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask the core to stop its actors and exit; kill it if it does not in time."""
        self._stopping = True
        if self._proc is not None and self._proc.poll() is None:
            try:
                with self._lock:
                    self._inputs.send(self._codec.encode(CoreInput(shutdown=True)), zmq.NOBLOCK)
                self._proc.wait(STOP_GRACE_S)
            except zmq.Again:  # no core connected: it has just ended (with its Ray cluster)
                self._proc.kill()
                self._proc.wait()
            except subprocess.TimeoutExpired:
                log.warning("%s did not exit within %s s; killing it", self.name,
                            STOP_GRACE_S)
                self._proc.kill()
                self._proc.wait()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=1.0)
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def replica_cpus(index: int, num_replicas: int) -> list[int]:
    """Replica ``index``'s share of the CPUs this process may use, so that replicas do not
    take each other's cores; [] (all) for one replica, or fewer CPUs than replicas."""
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // num_replicas
    if num_replicas == 1 or share == 0:
        return []
    return cpus[index * share:(index + 1) * share]


def _threads_env(cpus: list[int], ranks: int) -> dict | None:
    """The environment of a core limited to ``cpus``: as many OpenMP threads a rank as it has
    cores (unless the user chose); None: this process's own."""
    if not cpus or "OMP_NUM_THREADS" in os.environ:
        return None
    return {**os.environ, "OMP_NUM_THREADS": str(max(1, len(cpus) // ranks))}


def _bind(socket: zmq.Socket, tcp: bool, path: str) -> str:
    """Bind ``socket`` where its core will connect: a private ``ipc://`` path on this
    machine, or, for a core Ray may place on another node, a TCP port of this node's."""
    if not tcp:
        socket.bind(f"ipc://{path}")
        return f"ipc://{path}"
    from actorlm.engine_core.ray_core import node_address

    host = node_address()
    return f"tcp://{host}:{socket.bind_to_random_port(f'tcp://{host}')}"
