"""ProcessWorkerGroup: one worker process per rank (``--distributed-executor-backend mp``).

Each rank is a fresh interpreter running ``process_main`` (it loads the weights itself, through
the picklable runner factory) joined to this process by a socket pair wrapped in a
multiprocessing ``Connection``. A step is encoded once and the same bytes written to every rank.
A reader thread per rank blocks on its connection and on the process itself (a pidfd, where
Linux has one) and turns what it sees into the executor's messages: a reply into
``WorkerResult``, a fault, an EOF or the process's end into ``WorkerFailed`` — a ``kill -9`` is
seen at once, by EOF. ``start()`` blocks until every rank has loaded, and raises a rank's load
error in the caller as the thread backend would.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait

from actorlm.engine_actor import tell
from actorlm.executors.process_main import WorkerSpec
from actorlm.executors.wire import SHUTDOWN, WireCodec
from actorlm.executors.worker_loop import load_error_from
from actorlm.messages import GrammarBitmask, ScheduleStep, WorkerFailed, WorkerResult

log = logging.getLogger(__name__)

STOP_GRACE_S = 3.0  # a planned stop lets the ranks exit on their own this long, then kills
_BOOT = ("import sys, json; sys.path[:] = json.loads(sys.argv[2]); "
         "from actorlm.executors.process_main import main; main(int(sys.argv[1]))")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the rendezvous of the ranks' torch.distributed)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def exit_status(proc: subprocess.Popen) -> str:
    try:
        code = proc.wait(timeout=1.0)
    except subprocess.TimeoutExpired:
        return "closed its connection"
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


class ProcessWorkerGroup:
    def __init__(self, factory, size: int, generation: int, tensor_parallel: bool):
        self.factory, self.size, self.generation = factory, size, generation
        self.tensor_parallel = tensor_parallel
        self.codec = WireCodec()  # the executor's thread encodes; each reader decodes its own
        self.pids: list[int] = []
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._readers: list[threading.Thread] = []
        self._stopping = False

    def start(self) -> None:
        """Spawn every rank, then wait for them to load (the ranks of a tensor-parallel group
        meet in a collective while loading, so all must be running before any is awaited; the
        first load error ends the wait, since the other ranks may be waiting for that one)."""
        init_method = f"tcp://127.0.0.1:{free_port()}"
        try:
            for rank in range(self.size):
                self._spawn(rank, init_method)
            pids, loading = [0] * self.size, dict(zip(self._conns, range(self.size)))
            while loading:  # in any order: a rank's load error must not wait for the others
                for conn in wait(list(loading)):
                    rank = loading.pop(conn)
                    pids[rank] = self._await_loaded(rank)
            self.pids = pids
        except BaseException:
            self.stop(kill=True)
            raise
        log.info("worker processes started: pids %s", self.pids)

    def _spawn(self, rank: int, init_method: str) -> None:
        ours, theirs = socket.socketpair()
        try:
            proc = subprocess.Popen([sys.executable, "-c", _BOOT, str(theirs.fileno()),
                                     json.dumps(sys.path)], pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()  # only the child holds its end: its death is our EOF
        conn = Connection(ours.detach())
        self._procs.append(proc)
        self._conns.append(conn)
        conn.send(WorkerSpec(self.factory, rank, self.size, init_method, self.tensor_parallel,
                             os.getpid(), logging.getLogger().getEffectiveLevel()))

    def _await_loaded(self, rank: int) -> int:
        try:
            reply = self.codec.decode_reply(self._conns[rank].recv_bytes())
        except (EOFError, OSError):
            raise RuntimeError(f"worker process {rank} {exit_status(self._procs[rank])} while "
                               f"loading the model") from None
        if reply.load_error is not None:
            raise load_error_from(reply, f"worker process {rank}")
        return reply.pid

    def attach(self, executor) -> None:
        """Start reporting to ``executor`` (an actor ref, alive by now: a message to a ref
        not yet started would be lost, and with it a death)."""
        for rank in range(self.size):
            reader = threading.Thread(target=self._read, args=(rank, executor), daemon=True,
                                      name=f"actorlm-worker-{rank}-reader")
            reader.start()
            self._readers.append(reader)

    def _read(self, rank: int, executor) -> None:
        conn, proc, codec = self._conns[rank], self._procs[rank], WireCodec()
        process = _pidfd(proc.pid)
        try:
            while True:
                ready = wait([conn] if process is None else [conn, process])
                if conn not in ready:
                    break  # the process ended; its last words, if any, were read before
                try:
                    reply = codec.decode_reply(conn.recv_bytes())
                except (EOFError, OSError):
                    break
                if reply.result is not None:
                    tell(executor, WorkerResult(rank, reply.result))
                elif reply.fault is not None:
                    self._report(executor, rank, reply.fault)
                    return
            self._report(executor, rank, f"its process {exit_status(proc)}")
        finally:
            conn.close()
            if process is not None:
                os.close(process)

    def _report(self, executor, rank: int, error: str) -> None:
        if not self._stopping:
            tell(executor, WorkerFailed(rank, self.generation, error))

    def send_step(self, step: ScheduleStep) -> None:
        self._send(self.codec.encode_step(step), self._conns)  # one encoding, every rank

    def send_bitmask(self, bitmask: GrammarBitmask) -> None:
        # with tensor parallelism only rank 0 samples, and only it waits for the bitmask
        self._send(self.codec.encode_bitmask(bitmask),
                   self._conns[:1] if self.tensor_parallel else self._conns)

    @staticmethod
    def _send(data: bytes, conns: list[Connection]) -> None:
        for conn in conns:
            try:
                conn.send_bytes(data)
            except OSError:
                pass  # a rank that is gone: its reader reports it

    def stop(self, kill: bool = False) -> None:
        """Stop every rank: ``kill`` at once (after a fault: with tensor parallelism the
        survivors would hang in a collective), else ask them to exit, then kill stragglers."""
        self._stopping = True
        if not kill:
            self._send(SHUTDOWN, self._conns)
            deadline = time.monotonic() + STOP_GRACE_S
            for proc in self._procs:
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    log.warning("worker process %d did not exit within %s s; killing it",
                                proc.pid, STOP_GRACE_S)
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            try:
                proc.wait(timeout=5.0)  # reaped: no zombie left behind
            except subprocess.TimeoutExpired:
                log.warning("worker process %d did not die", proc.pid)
        if not self._readers:  # no reader owns the connections
            for conn in self._conns:
                conn.close()


def _pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits (Linux >= 5.3), else None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None
