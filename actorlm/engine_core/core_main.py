"""An engine-core process's main: the scheduler, the KV allocator and the executor (with its
workers: a thread here for one rank, processes of their own for more) behind two ZMQ sockets.

The child is a fresh interpreter started by ``EngineCoreClient`` (``python -c``, the parent's
``sys.path`` on its command line, as the worker processes are); its ``CoreSpec`` arrives on
stdin. It connects to the two sockets the frontend has bound, loads the model, starts the
actors (``EngineSystem`` with a relay in the frontend's place) and answers ``CoreReady``; then
its main thread reads the frontend's messages and hands them to the scheduler, and the relay
sends each step's ``EngineOutputs`` back from the scheduler's thread. It never outlives the
frontend (a watchdog thread, as a worker's; it removes the frontend's socket directory,
which a frontend killed outright leaves behind), and it names itself ``actorlm::engine-core``
(``actorlm::engine-core-<i>`` for data-parallel replica i). Under ``--data-parallel-backend
ray`` a Ray actor runs it (``ray_core``), the parent's death then Ray's to handle.
Its main thread also sends a heartbeat, the scheduler's answer to a stats query, twice a
second: a core whose scheduler stops answering falls silent, and the frontend restarts it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

import pykka
import zmq

from actorlm.engine_core.wire import (Answer, CoreCodec, CoreInput, CoreOutput, CoreReady,
                                      CoreSpec, decode_spec)
from actorlm.messages import GetStats

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5


class OutputRelay:
    """The frontend as the scheduler sees it in this process: ``tell(EngineOutputs)`` sends
    the step's outputs, with the trace records made since the last send. Answers to queries
    leave through it too, from the main thread, hence the lock."""

    def __init__(self, socket: zmq.Socket, generation: int, trace=None):
        self._socket, self._generation, self._trace = socket, generation, trace
        self._codec = CoreCodec()
        self._lock = threading.Lock()

    def tell(self, outputs) -> None:
        self.send(outputs=outputs)

    def send(self, **fields) -> None:
        trace = self._trace.take_new() if self._trace is not None else []
        output = CoreOutput(self._generation, trace=trace, **fields)
        with self._lock:
            self._socket.send(self._codec.encode(output), copy=False)


def answer(system, message: CoreInput) -> Answer:
    """The query's answer, from the actors (blocking asks: this is the main thread)."""
    try:
        if message.ask == "scheduler_stats":
            return Answer(message.ask_id, scheduler_stats=system.scheduler_stats())
        if message.ask == "kv_stats":
            return Answer(message.ask_id, kv_stats=system.kv_stats())
        if message.ask == "executor_stats":
            return Answer(message.ask_id, executor_stats=system.executor_stats())
        if message.ask == "reset_prefix_cache":
            return Answer(message.ask_id, reset_prefix_cache=system.reset_prefix_cache())
        return Answer(message.ask_id, error=f"unknown query {message.ask!r}")
    except Exception as exc:  # noqa: BLE001 — the asker raises it
        return Answer(message.ask_id, error=f"{type(exc).__name__}: {exc}")


def serve(system, inputs: zmq.Socket, relay: OutputRelay) -> None:
    """Hand the frontend's messages on until it says shutdown; between them, every
    ``HEARTBEAT_S``, tell the frontend the scheduler still answers (its stats: a scheduler
    that hangs stops the heartbeat, and the frontend then restarts this core)."""
    codec = CoreCodec()
    scheduler = system.scheduler
    next_beat = time.monotonic()
    while True:
        if time.monotonic() >= next_beat:
            try:
                relay.send(heartbeat=scheduler.ask(GetStats(), timeout=HEARTBEAT_S))
            except pykka.Timeout:
                pass  # no word: the frontend's deadline runs on
            next_beat = time.monotonic() + HEARTBEAT_S
        if not inputs.poll(int(1000 * max(0.0, next_beat - time.monotonic())) + 1):
            continue
        message = codec.decode_input(inputs.recv(copy=False).bytes)
        if message.shutdown:
            return
        for add in message.add:
            scheduler.tell(add)
        if message.abort is not None:
            scheduler.tell(message.abort)
        if message.stop is not None:
            scheduler.tell(message.stop)
        if message.ask is not None:
            relay.send(answer=answer(system, message))


def main() -> None:
    from actorlm.executors.process_main import exit_with_parent

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the frontend's to handle
    spec = decode_spec(sys.stdin.buffer.read())
    exit_with_parent(spec.parent_pid, leftover=_socket_dir(spec.input_address))
    run(spec)


def _socket_dir(address: str) -> str | None:
    """The directory of the frontend's ipc sockets (none under Ray: tcp)."""
    return os.path.dirname(address.removeprefix("ipc://")) if address.startswith("ipc://") \
        else None


def run(spec: CoreSpec) -> None:
    """The core, from its spec to its shutdown (a Ray actor calls this, in its own process)."""
    from actorlm.actors.system import EngineSystem
    from actorlm.executors.process_main import set_process_title
    from actorlm.executors.worker_loop import failure_reply

    name = f"engine-core-{spec.index}" if spec.config.data_parallel_size > 1 else "engine-core"
    set_process_title(f"actorlm::{name}")
    logging.basicConfig(level=spec.log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s [{name}] %(name)s: %(message)s")
    if spec.cpus:  # its share of the machine, its workers' included (they inherit it)
        os.sched_setaffinity(0, spec.cpus)
    context = zmq.Context()
    inputs, outputs = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inputs.connect(spec.input_address)
    outputs.connect(spec.output_address)
    trace = None
    if spec.trace:
        from actorlm.trace import TraceRecorder

        trace = TraceRecorder(capacity=spec.trace_capacity)
        trace.forward()
    relay = OutputRelay(outputs, spec.generation, trace)
    try:
        system = EngineSystem(spec.config, trace=trace, frontend=relay)
    except BaseException as exc:  # noqa: BLE001 — the frontend raises it
        relay.send(load_failure=failure_reply(exc))
        outputs.close(linger=5000)
        return
    relay.send(ready=CoreReady(
        system.config, str(system.model_path), str(system.dtype).removeprefix("torch."),
        str(system.device), system.backend_name, system.hf_config.vocab_size,
        list(system.kv_cache_windows), os.getpid()))
    try:
        serve(system, inputs, relay)
    finally:
        system.stop()
        outputs.close(linger=1000)


if __name__ == "__main__":
    main()
