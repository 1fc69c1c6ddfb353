"""GroupStarter: starts the executor's replacement worker groups, each on a thread of its own.

Loading weights takes seconds, and the executor keeps answering meanwhile; for thread workers
the loading thread's OpenMP pool leaves with it (see ``actorlm.openmp``). A started group is
handed over as ``WorkerRestarted`` through ``deliver``; until the executor has claimed it, it is
this object's, since an executor that stops in between will not read its inbox again: ``close``
stops it, and stops a group that finishes starting after it.
"""

from __future__ import annotations

import threading
from typing import Callable

from actorlm.messages import WorkerRestarted


class GroupStarter:
    def __init__(self, new_group: Callable[[int], object],
                 deliver: Callable[[WorkerRestarted], None]):
        self.new_group = new_group  # new_group(generation): a group, not started
        self.deliver = deliver
        self._lock = threading.Lock()  # the loading thread's hand-over against close()
        self._closed = False
        self._unclaimed = None  # delivered, not yet claimed

    def start(self, generation: int) -> None:
        """Start a group of ``generation`` in the background; it arrives through ``deliver``."""
        threading.Thread(target=self._start, args=(generation,), name="actorlm-restart",
                         daemon=True).start()

    def claim(self) -> None:
        """The executor has received the delivered group: it is the executor's to stop."""
        with self._lock:
            self._unclaimed = None

    def close(self) -> None:
        """The executor stops: stop a group it has not claimed, now or once it has started."""
        with self._lock:
            self._closed = True
            group, self._unclaimed = self._unclaimed, None
        if group is not None:
            group.stop()

    def _start(self, generation: int) -> None:
        group = self.new_group(generation)
        try:
            group.start()
        except Exception as exc:  # noqa: BLE001 — reported to the executor, which fails
            self.deliver(WorkerRestarted(generation, error=f"{type(exc).__name__}: {exc}"))
            return
        with self._lock:
            if not self._closed:
                self._unclaimed = group
                self.deliver(WorkerRestarted(generation, group))
                return
        group.stop(kill=True)
