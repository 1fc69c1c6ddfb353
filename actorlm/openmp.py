"""Keep torch's CPU work to one OpenMP thread pool: the worker's.

libgomp gives each thread that runs a parallel torch op a pool of its own for the rest of
that thread's life, and once a process holds more pool threads than cores, all of them stop
spin-waiting between parallel regions. Every op of the worker's step then puts its pool to
sleep and wakes it again: about 1,300 context switches per SmolLM2 decode step and 15 % of
decode throughput on 2 cores. So heavy one-off torch work (loading and dequantizing weights)
runs on a thread that exits when it is done, taking its pool with it.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

T = TypeVar("T")


def on_passing_thread(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on a fresh thread that exits before this returns; its exception re-raised."""
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 — re-raised in the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="actorlm-load")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]
