"""Supervisor: who hears when an engine actor dies, so that no caller waits forever.

The workers are supervised by the executor, which restarts them and has their steps
recomputed (see ``executor``). The four core actors — frontend, scheduler, allocator and
executor — hold state no one else has (every live request, every block), so a core actor that
fails or stops outside ``EngineSystem.stop()`` ends the engine: the supervisor records why,
once, and calls every watcher at once on the dying actor's thread. ``LLM.generate`` and
``AsyncLLM`` watch it and fail their live requests with ``EngineDeadError`` instead of
waiting on an output that will never come.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)

Watcher = Callable[["EngineDeadError"], None]


class EngineDeadError(RuntimeError):
    """The engine can no longer serve requests (an actor died, or it has shut down)."""


class EngineShutdownError(EngineDeadError):
    """The engine was stopped on purpose (``shutdown()``, a server draining on SIGTERM)."""


class Supervisor:
    """Thread-safe: actors report from their own threads, callers watch from theirs."""

    def __init__(self):
        self._lock = threading.Lock()
        self._error: EngineDeadError | None = None
        self._watchers: dict[int, Watcher] = {}
        self._ids = itertools.count()

    @property
    def error(self) -> EngineDeadError | None:
        """Why the engine is dead, or None while it serves."""
        return self._error

    def dead_error(self) -> EngineDeadError:
        """A fresh error to raise for an engine found dead (an actor ref that has stopped
        may be seen an instant before its death is reported here)."""
        error = self._error
        return EngineDeadError("an engine actor has stopped") if error is None else \
            type(error)(str(error))

    def actor_died(self, name: str, reason: str) -> None:
        """A core actor failed or stopped on its own: the engine is dead."""
        self._end(EngineDeadError(f"the engine is dead: the {name} actor {reason}"), log.error)

    def engine_died(self, reason: str) -> None:
        """The engine is dead for ``reason`` (an engine core that could not be restarted)."""
        self._end(EngineDeadError(f"the engine is dead: {reason}"), log.error)

    def shutting_down(self) -> None:
        """``EngineSystem.stop()`` has begun: actors stopping now is the plan, not a fault."""
        self._end(EngineShutdownError("the engine has shut down"), log.debug)

    def watch(self, watcher: Watcher) -> int:
        """Call ``watcher(error)`` when the engine dies (at once if it is already dead).
        Watchers run on the dying actor's thread: they must be quick and must not block."""
        with self._lock:
            error = self._error
            key = next(self._ids)
            if error is None:
                self._watchers[key] = watcher
        if error is not None:
            watcher(error)
        return key

    def unwatch(self, key: int) -> None:
        with self._lock:
            self._watchers.pop(key, None)

    def _end(self, error: EngineDeadError, report) -> None:
        with self._lock:
            if self._error is not None:
                return
            self._error = error
            watchers, self._watchers = list(self._watchers.values()), {}
        report("%s", error)
        for watcher in watchers:
            try:
                watcher(error)
            except Exception:  # noqa: BLE001 — one broken watcher must not silence the rest
                log.exception("a watcher of the engine's death raised")
