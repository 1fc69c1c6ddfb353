"""Running a function on every rank of a tensor-parallel group of CPU processes (gloo).

``run_ranks(fn, size, *args)`` spawns ``size`` processes; each joins the group through
``init_tensor_parallel`` and returns ``fn(tp, *args)``; the parent gets every rank's return
value, in rank order, or the first rank's traceback as an AssertionError. ``fn`` and its
arguments must pickle (a module-level function; paths, not fixtures), and it should return
plain data (lists, numpy arrays): a tensor would travel as shared memory of a process that
exits.
"""

from __future__ import annotations

import queue
import socket
import time
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, size, port, fn, args, results):
    torch.set_num_threads(1)  # two ranks share the two cores of a small machine
    from actorlm.models.parallel import init_tensor_parallel

    try:
        tp = init_tensor_parallel(rank, size, f"tcp://127.0.0.1:{port}", torch.device("cpu"))
        report = (rank, True, fn(tp, *args))
    except BaseException:  # noqa: BLE001 — reported to the parent, which raises it
        report = (rank, False, traceback.format_exc())
    results.put(report)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def run_ranks(fn, size: int, *args, timeout: float = 120.0) -> list:
    """``[fn(tp, *args) on rank 0, ..., on rank size - 1]``, each in a spawned process."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(rank, size, port, fn, args, results),
                         daemon=True) for rank in range(size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(failures) < size and time.monotonic() < deadline:
            # exited before this wait began: a report it sent is in the queue by now
            exited = {rank: p.exitcode for rank, p in enumerate(procs) if p.exitcode is not None}
            try:
                rank, ok, value = results.get(timeout=1.0)
                (out if ok else failures)[rank] = value
            except queue.Empty:
                for rank, code in exited.items():
                    if rank not in out and rank not in failures:
                        failures[rank] = f"exited with code {code} and no result"
            if failures:  # the others get a moment to say why: the root cause may be theirs
                deadline = min(deadline, time.monotonic() + 5.0)
        missing = set(range(size)) - set(out) - set(failures)
        if failures or missing:
            raise AssertionError("\n".join(
                [f"rank {rank}: {why}" for rank, why in sorted(failures.items())] +
                [f"rank {rank}: no result within {timeout} s" for rank in sorted(missing)]))
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():  # a rank stuck in a collective whose peer failed
                p.kill()
                p.join()
    return [out[rank] for rank in range(size)]


def share(tp, obj):
    """Rank 0's ``obj`` on every rank, as the executor sends every rank the same message."""
    if not tp.is_parallel:
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]
