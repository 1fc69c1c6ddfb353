"""FaultInjector: make workers fault on cue, to prove that a fault costs no request.

It wraps every model runner the engine builds — ``EngineSystem(config, wrap_runner=faults.wrap)``
or ``EngineHarness(..., wrap_runner=faults.wrap)``, around the real model or a fake — and
shares one plan between them, so the runner built to replace a faulted worker follows the same
plan. Steps are counted over every wrapped runner, from 0, in the order they execute:

- ``raise_at(n)``: step ``n`` raises ``InjectedFault`` inside the runner (a transient fault,
  e.g. an out-of-memory error on one large batch);
- ``kill_at(n)``: in step ``n`` the worker's thread dies (``InjectedDeath``, a
  ``BaseException``, escapes the worker's own guard);
- ``poison(request_id)``: every step that runs that request raises (a poison request).

A faulting step raises before the wrapped runner sees it, so a fake runner shared between
restarts keeps cached request state that agrees with the scheduler.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from actorlm.messages import ScheduleStep, StepResult
from actorlm.testing.fake_runner import FakeModelRunner, InjectedFault


class InjectedDeath(BaseException):
    """Escapes the worker's handler: its actor fails and its thread ends."""


class FaultInjector:
    def __init__(self):
        self._lock = threading.Lock()  # armed from the test's thread, read on workers'
        self._raise_at: dict[int, str] = {}
        self._kill_at: set[int] = set()
        self._poisoned: set[str] = set()
        self.num_steps = 0  # steps that reached a wrapped runner
        self.faulted_steps: list[int] = []  # their indices

    def wrap(self, runner) -> FaultyRunner:
        return FaultyRunner(runner, self)

    def raise_at(self, step_index: int, error: str = "injected fault") -> None:
        with self._lock:
            self._raise_at[step_index] = error

    def kill_at(self, step_index: int) -> None:
        with self._lock:
            self._kill_at.add(step_index)

    def poison(self, request_id: str) -> None:
        with self._lock:
            self._poisoned.add(request_id)

    def check(self, step: ScheduleStep) -> None:
        """Raise if this step is to fault (called by the wrapped runners)."""
        with self._lock:
            index, self.num_steps = self.num_steps, self.num_steps + 1
            kill = index in self._kill_at
            error = self._raise_at.pop(index, None)
            poisoned = self._poisoned.intersection(step.request_ids)
            if kill or error is not None or poisoned:
                self.faulted_steps.append(index)
        if kill:
            raise InjectedDeath(f"step {index}: the worker's thread dies")
        if error is not None:
            raise InjectedFault(f"step {index}: {error}")
        if poisoned:
            raise InjectedFault(f"step {index}: poisoned by {sorted(poisoned)}")


class FaultyRunner:
    """A model runner that consults its ``FaultInjector`` before every step."""

    def __init__(self, runner, faults: FaultInjector):
        self.runner, self.faults = runner, faults

    def execute(self, step: ScheduleStep) -> StepResult:
        self.faults.check(step)
        return self.runner.execute(step)

    def __getattr__(self, name: str):
        return getattr(self.runner, name)


@dataclass(frozen=True)
class FakeRunnerFactory:
    """``make_runner`` building a ``FakeModelRunner(vocab_size=...)``: plain data, so a worker
    process or a Ray actor can build its own (tests of the mp and ray backends). With
    ``fail_rank`` that rank raises ``fail_with`` while loading."""

    vocab_size: int = 1000
    fail_rank: int | None = None
    fail_with: str = "no such checkpoint"

    def __call__(self, rank: int) -> FakeModelRunner:
        if rank == self.fail_rank:
            raise ValueError(f"rank {rank}: {self.fail_with}")
        return FakeModelRunner(vocab_size=self.vocab_size)
