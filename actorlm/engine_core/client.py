"""EngineCoreClient: the frontend's side of one engine-core process.

It binds the two sockets (``ipc://`` in a private directory), starts the core (``core_main``)
and waits for it to load. It then stands in for the scheduler: the FrontendActor ``tell``s it
its ``AddRequest``, ``AbortRequests`` and ``StopRequests``, which it sends on; a reader thread
receives each step's ``EngineOutputs`` and tells the FrontendActor, feeds the core's trace
records to the frontend's recorder, and answers the queries (``ask``) that wait on it.

When the core dies (``kill -9``, a crash) the reader sees it (the process has ended, checked
every poll), and when it hangs (``HANG_S`` without a word, heartbeats included) the reader
kills it; either way it restarts it: what the frontend sends meanwhile is held; the outputs the dead
core still sent are delivered; then the new core gets every live request back from the
FrontendActor (``ResumeRequests``: the prompt and the tokens streamed so far, recomputed as
after a preemption), and what was held follows. Outputs are stamped with their core's
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
from actorlm.messages import AbortRequests, AddRequest, ResumeRequests, StopRequests

log = logging.getLogger(__name__)

_BOOT = ("import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
         "from actorlm.engine_core.core_main import main; main()")
POLL_MS = 100  # the reader checks that the core still runs at least this often
ASK_TIMEOUT_S = 30.0
DRAIN_S = 0.2  # after a death: how long the dead core's last outputs may take to arrive
HANG_S = 30.0  # a core silent this long (no output, no heartbeat) hangs, and is killed
STOP_GRACE_S = 5.0


class EngineCoreDied(RuntimeError):
    """The engine core died, and could not be restarted, while a query waited for it."""


class EngineCoreClient:
    def __init__(self, config: EngineConfig, *, trace=None, index: int = 0):
        self.config, self.trace, self.index = config, trace, index
        self.num_restarts = 0
        self.ready: CoreReady | None = None
        self._context = zmq.Context()
        self._dir = tempfile.mkdtemp(prefix="actorlm-core-")
        self._inputs = self._context.socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.SNDHWM, 0)  # never full: a send fails only with no core
        self._inputs.bind(f"ipc://{self._dir}/in")
        self._outputs = self._context.socket(zmq.PULL)
        self._outputs.bind(f"ipc://{self._dir}/out")
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
        spec = CoreSpec(self.config, f"ipc://{self._dir}/in", f"ipc://{self._dir}/out",
                        os.getpid(), logging.getLogger().getEffectiveLevel(), self.index,
                        self.trace is not None, self._generation)
        self._proc = subprocess.Popen([sys.executable, "-c", _BOOT, json.dumps(sys.path)],
                                      stdin=subprocess.PIPE)
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
                    raise load_error_from(output.load_failure, "the engine core")
                if output.ready is not None:
                    self._ingest_trace(output.trace)
                    return output.ready
            elif self._proc.poll() is not None:
                raise RuntimeError(f"the engine core exited with code {self._proc.returncode} "
                                   f"while loading the model")

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
            raise RuntimeError(f"the engine core could not answer {query}: {answer.error}")
        return answer

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
                log.error("the engine core has not been heard from for %.0f s; killing it",
                          time.monotonic() - heard)
                self._proc.kill()
                self._proc.wait()

    def _deliver(self, output) -> None:
        if output.generation != self._generation:
            return  # a dead core's late words: its requests have been resumed elsewhere
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
        log.error("the engine core %s; restarting it (restart %d)", reason, self.num_restarts)
        try:
            self.ready = self._spawn()
        except Exception as exc:  # noqa: BLE001 — the engine ends with this reason
            log.error("the engine core could not be restarted: %s", exc)
            for _, future in list(self._asks.values()):
                future.set_exception(EngineCoreDied(f"the engine core {reason}"))
            self._on_dead(f"the engine core {reason} and could not be restarted: {exc}")
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
        log.info("the engine core is back (pid %d); %d request(s) resumed", self._proc.pid,
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
            except (zmq.Again, subprocess.TimeoutExpired):
                log.warning("the engine core did not exit within %s s; killing it",
                            STOP_GRACE_S)
                self._proc.kill()
                self._proc.wait()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=1.0)
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        self._context.term()
        shutil.rmtree(self._dir, ignore_errors=True)

