"""The worker side shared by worker processes (``process_main``) and Ray actors (``ray_group``):
build a rank's runner where it will run, then turn step bytes into reply bytes.

``build_runner`` sizes torch's thread pool (the ranks share the machine's cores, unless the user
set ``OMP_NUM_THREADS``), joins the tensor-parallel group when there is one (it must precede
loading: the model shards its weights by rank), and loads the weights through the factory.
``WorkerLoop`` owns the runner from then on: nothing else in its process touches it.
"""

from __future__ import annotations

import logging
import os
import pickle
import traceback

from actorlm.executors.wire import WireCodec, WorkerReply

log = logging.getLogger(__name__)


def build_runner(factory, rank: int, size: int, init_method: str, tensor_parallel: bool):
    """``factory(rank)`` in this process, after the set-up a rank of ``size`` needs."""
    import torch

    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    if tensor_parallel:
        from actorlm.models.parallel import init_tensor_parallel  # only a sharded model needs it

        init_tensor_parallel(rank, size, init_method, factory.device)
    return factory(rank)


def load_failure(codec: WireCodec, exc: BaseException) -> bytes:
    """The reply that carries a load error to the caller (pickled when it can be, so the caller
    raises the very exception the thread backend would)."""
    return codec.encode_reply(failure_reply(exc))


def failure_reply(exc: BaseException) -> WorkerReply:
    """``load_failure``'s reply, not yet encoded."""
    try:
        pickled = pickle.dumps(exc)
        pickle.loads(pickled)  # an exception whose __init__ wants other arguments fails here
    except Exception:  # noqa: BLE001 — the text below still says what went wrong
        pickled = b""
    text = "".join(traceback.format_exception(exc)).rstrip()
    return WorkerReply(load_error=text, exception=pickled)


def load_error_from(reply: WorkerReply, where: str) -> BaseException:
    """The caller's side of ``load_failure``: the worker's exception, with its traceback as a
    note, or a RuntimeError holding that traceback when the exception did not survive."""
    if reply.exception:
        try:
            exc = pickle.loads(reply.exception)
        except Exception:  # noqa: BLE001 — a type that does not exist here: fall back to text
            pass
        else:
            exc.add_note(f"(raised in {where}:\n{reply.load_error})")
            return exc
    return RuntimeError(f"{where} could not load the model:\n{reply.load_error}")


class WorkerLoop:
    """One rank's runner behind the wire. ``handle(call_bytes)`` returns the reply's bytes, or
    ``b""`` when there is nothing to say (a constrained step waits for its bitmask; with tensor
    parallelism the other ranks return an empty result, which does travel: the executor gathers
    every rank's, timings included). After a fault or a shutdown call it ``is_done``."""

    def __init__(self, runner, rank: int):
        self.runner, self.rank = runner, rank
        self.codec = WireCodec()
        self.is_done = False

    def handle(self, data: bytes) -> bytes:
        call = self.codec.decode_call(data)
        if call.shutdown:
            self.is_done = True
            self.runner = None  # the device memory goes before the process does
            return b""
        if self.is_done:
            return b""
        try:
            if call.step is not None:
                result = self.runner.execute(call.step)
            else:
                result = self.runner.sample_tokens(call.bitmask)
        except Exception as exc:  # noqa: BLE001 — the executor restarts every rank
            step_id = call.step.step_id if call.step is not None else call.bitmask.step_id
            log.error("worker %d: step %d raised; the workers will be restarted", self.rank,
                      step_id, exc_info=True)
            self.is_done = True
            return self.codec.encode_reply(WorkerReply(fault=f"{type(exc).__name__}: {exc}"))
        if result is None:
            return b""
        return self.codec.encode_reply(WorkerReply(result=result))
