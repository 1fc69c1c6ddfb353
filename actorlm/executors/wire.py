"""What crosses the boundary to a worker process or Ray actor, and its msgpack encoding.

Both directions travel as one typed envelope each, decoded with a typed msgspec ``Decoder``
on the other side (so a malformed frame fails loudly, and a ``SamplingParams`` inside a
``NewRequestData`` arrives as a ``SamplingParams``, validated again by its ``__post_init__``).
The envelopes are ``array_like``: no field names on the wire, like the step messages inside.

A step goes to every rank as the same bytes: ``encode_call`` runs once per step, not per rank.
"""

from __future__ import annotations

import msgspec

from actorlm.messages import GrammarBitmask, ScheduleStep, StepResult


class WorkerCall(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Parent -> worker: exactly one of a step to run, the bitmask a constrained step waits
    for, or ``shutdown`` (finish, release the device, exit)."""

    step: ScheduleStep | None = None
    bitmask: GrammarBitmask | None = None
    shutdown: bool = False


class WorkerReply(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Worker -> parent: one of

    - ``pid``: the runner is built (weights loaded); the worker serves from now on;
    - ``load_error``: it could not be built; ``exception`` is the pickled exception (re-raised
      in the caller as the thread backend would), ``load_error`` its text and traceback;
    - ``result``: a step's result (this rank's; with tensor parallelism only rank 0 samples);
    - ``fault``: the runner raised in a step; its batch is half-updated, the worker is done.
    """

    pid: int = 0
    load_error: str | None = None
    exception: bytes = b""
    result: StepResult | None = None
    fault: str | None = None


SHUTDOWN = msgspec.msgpack.encode(WorkerCall(shutdown=True))


class WireCodec:
    """One side's encoder and typed decoders (msgspec reuses their buffers and type plans,
    so each process or actor keeps one)."""

    def __init__(self):
        self._encoder = msgspec.msgpack.Encoder()
        self._calls = msgspec.msgpack.Decoder(WorkerCall)
        self._replies = msgspec.msgpack.Decoder(WorkerReply)

    def encode_call(self, call: WorkerCall) -> bytes:
        return self._encoder.encode(call)

    def encode_step(self, step: ScheduleStep) -> bytes:
        return self._encoder.encode(WorkerCall(step=step))

    def encode_bitmask(self, bitmask: GrammarBitmask) -> bytes:
        return self._encoder.encode(WorkerCall(bitmask=bitmask))

    def decode_call(self, data: bytes) -> WorkerCall:
        return self._calls.decode(data)

    def encode_reply(self, reply: WorkerReply) -> bytes:
        return self._encoder.encode(reply)

    def decode_reply(self, data: bytes) -> WorkerReply:
        return self._replies.decode(data)
