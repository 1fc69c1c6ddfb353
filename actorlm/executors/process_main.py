"""A worker process's main: what runs in the child that ``ProcessWorkerGroup`` starts.

The child is a fresh interpreter (``python -c``, as multiprocessing's spawn, but without
re-running the caller's ``__main__``: a script with no ``if __name__ == "__main__"`` guard
works). It gets the parent's ``sys.path`` on its command line, so it imports the same actorlm,
and a socket to the parent as an inherited file descriptor. The first frame on it is a pickled
``WorkerSpec`` (plain data: the runner factory and this rank's place); every frame after that
is msgpack (``wire``).

It never outlives the parent: an idle child reads EOF when the parent is gone, and a watchdog
thread exits a busy one (a rank stuck in a collective waits for no EOF). ``PR_SET_PDEATHSIG``
is not used: it fires when the *thread* that started the child exits, and restarts start
children from passing threads.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

PARENT_POLL_S = 0.5


@dataclass(frozen=True)
class WorkerSpec:
    factory: Any  # RunnerFactory or any picklable rank -> runner
    rank: int
    size: int
    init_method: str  # torch.distributed rendezvous, tcp://127.0.0.1:PORT
    tensor_parallel: bool
    parent_pid: int
    log_level: int


def exit_with_parent(parent_pid: int, leftover: str | None = None) -> None:
    """Exit once the parent is gone, removing the directory ``leftover`` first (the parent's,
    which a parent killed outright could not remove)."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        if leftover is not None:
            shutil.rmtree(leftover, ignore_errors=True)
        os._exit(1)  # the parent is gone: no one will read what this rank computes

    threading.Thread(target=watch, name="actorlm-parent-watch", daemon=True).start()


def set_process_title(title: str) -> None:
    """What ``ps`` and ``top`` show for this process (where ``setproctitle`` is installed)."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)


def main(fd: int) -> None:
    from actorlm.executors.wire import WireCodec, WorkerReply
    from actorlm.executors.worker_loop import WorkerLoop, build_runner, load_failure

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    conn = Connection(fd)
    spec: WorkerSpec = conn.recv()
    exit_with_parent(spec.parent_pid)
    set_process_title(f"actorlm::worker-{spec.rank}")
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [worker {spec.rank}] %(name)s: "
                               f"%(message)s")
    codec = WireCodec()
    try:
        runner = build_runner(spec.factory, spec.rank, spec.size, spec.init_method,
                              spec.tensor_parallel)
    except BaseException as exc:  # noqa: BLE001 — the caller raises it
        conn.send_bytes(load_failure(codec, exc))
        return
    conn.send_bytes(codec.encode_reply(WorkerReply(pid=os.getpid())))
    loop = WorkerLoop(runner, spec.rank)
    while not loop.is_done:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the parent closed the pipe or died
        reply = loop.handle(data)
        if reply:
            conn.send_bytes(reply)


if __name__ == "__main__":
    main(int(sys.argv[1]))
