"""What crosses between the frontend and an engine-core process, and its msgpack encoding.

The messages are the engine's own (``actorlm/messages.py``): the frontend's ``AddRequest``,
``AbortRequests`` and ``StopRequests`` one way, the scheduler's ``EngineOutputs`` (one per
step, every request's delta in it) the other, each in one typed ``array_like`` envelope, so
the frontend's side costs one encode and one decode a step. A query (the stats behind
``/metrics``, a prefix-cache reset) is an ``ask`` with a number the answer carries back. The
trace records the core makes ride with the step's outputs, to the frontend's recorder.
"""

from __future__ import annotations

import msgspec

from actorlm.config import EngineConfig
from actorlm.executors.wire import WorkerReply
from actorlm.messages import (AbortRequests, AddRequest, EngineOutputs, ExecutorStats, KVStats,
                              SchedulerStats, StopRequests)
from actorlm.trace.records import Record

QUERIES = ("scheduler_stats", "kv_stats", "executor_stats", "reset_prefix_cache")


class CoreSpec(msgspec.Struct, frozen=True):
    """How the frontend starts a core: on its stdin, once."""

    config: EngineConfig
    input_address: str  # the frontend binds both; the core connects
    output_address: str
    parent_pid: int = 0  # it exits when this process is gone
    log_level: int = 20
    index: int = 0  # its replica (process title, logs)
    trace: bool = False  # record the run and send the records with the outputs
    generation: int = 0  # which start of this replica it is (its outputs carry it)
    trace_capacity: int = 100_000
    cpus: list[int] = []  # the CPUs it and its workers may use (a replica's share); []: all


class CoreReady(msgspec.Struct, frozen=True):
    """The core has loaded the weights and started its actors: what the frontend needs of the
    model beyond its tokenizer, as the core resolved it."""

    config: EngineConfig  # resolved (lengths, the KV pool)
    model_path: str
    dtype: str
    device: str
    backend_name: str
    vocab_size: int
    kv_cache_windows: list[int | None]
    pid: int


class CoreInput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Frontend -> core: requests to add, ids to abort or stop, or one query."""

    add: list[AddRequest] = []
    abort: AbortRequests | None = None
    stop: StopRequests | None = None
    ask: str | None = None  # one of QUERIES
    ask_id: int = 0
    shutdown: bool = False


class Answer(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A query's answer, in the field that bears the query's name."""

    ask_id: int
    scheduler_stats: SchedulerStats | None = None
    kv_stats: KVStats | None = None
    executor_stats: ExecutorStats | None = None
    reset_prefix_cache: bool | None = None
    error: str | None = None


class CoreOutput(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Core -> frontend: ready (or why it could not load), a step's outputs, an answer, or a
    heartbeat."""

    generation: int
    ready: CoreReady | None = None
    load_failure: WorkerReply | None = None  # as a worker's (executors/worker_loop.py)
    outputs: EngineOutputs | None = None
    answer: Answer | None = None
    heartbeat: SchedulerStats | None = None  # the scheduler still answers
    trace: list[Record] = []


class CoreCodec:
    """One side's encoder and typed decoders (one per thread that uses it)."""

    def __init__(self):
        self._encoder = msgspec.msgpack.Encoder()
        self._inputs = msgspec.msgpack.Decoder(CoreInput)
        self._outputs = msgspec.msgpack.Decoder(CoreOutput)

    def encode(self, message: CoreInput | CoreOutput | CoreSpec) -> bytes:
        return self._encoder.encode(message)

    def decode_input(self, data: bytes) -> CoreInput:
        return self._inputs.decode(data)

    def decode_output(self, data: bytes) -> CoreOutput:
        return self._outputs.decode(data)


def decode_spec(data: bytes) -> CoreSpec:
    return msgspec.msgpack.decode(data, type=CoreSpec)
