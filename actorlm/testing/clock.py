"""ManualClock: time that moves only when a test says so.

Every actor that reads time takes a clock: any object with ``monotonic()`` (and ``time()`` for
wall-clock stamps). The real one is the ``time`` module itself; tests pass a ``ManualClock`` so
that arrival times, step latencies and timeouts are exact numbers instead of races.
"""

from __future__ import annotations

import threading


class ManualClock:
    """A clock that starts at ``start`` seconds and moves only through ``advance``.

    Thread-safe: a ``FakeModelRunner`` advances it from a worker thread while the test reads it.
    """

    def __init__(self, start: float = 0.0, wall_start: float = 1_700_000_000.0):
        self._lock = threading.Lock()
        self._now_ns = round(start * 1e9)  # integer nanoseconds: many small steps never drift
        self._wall_offset = wall_start - start

    def now(self) -> float:
        """Seconds on the monotonic scale (same as ``monotonic()``)."""
        with self._lock:
            return self._now_ns / 1e9

    monotonic = now

    def time(self) -> float:
        """Wall-clock seconds since the epoch: a fixed start plus the elapsed manual time."""
        return self.now() + self._wall_offset

    def advance(self, seconds: float) -> float:
        """Move time forward by ``seconds`` (never backwards); returns the new ``now()``."""
        if seconds < 0:
            raise ValueError(f"a clock only moves forward; advance({seconds}) is negative")
        with self._lock:
            self._now_ns += round(seconds * 1e9)
            return self._now_ns / 1e9

    def __repr__(self) -> str:
        return f"ManualClock(now={self.now():.6f})"
