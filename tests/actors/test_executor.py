"""The executor builds its workers' runners on a passing thread and surfaces load errors."""

from __future__ import annotations

import threading

import pytest

from actorlm.actors.executor import ExecutorActor
from actorlm.testing import FakeModelRunner


def test_runners_are_built_on_a_thread_that_has_exited(make_probe):
    built_on = []

    def make_runner(rank):
        built_on.append(threading.current_thread())
        return FakeModelRunner()

    executor = ExecutorActor.start(make_runner, 2, make_probe())
    try:
        # The loading thread's OpenMP pool must not outlive it: the worker's is to be the only one.
        assert len(built_on) == 2
        assert all(t is not threading.current_thread() and not t.is_alive() for t in built_on)
    finally:
        executor.stop()


def test_a_load_error_reaches_the_caller_unchanged(make_probe):
    def make_runner(rank):
        raise ValueError(f"rank {rank}: no such checkpoint")

    with pytest.raises(ValueError, match="rank 0: no such checkpoint"):
        ExecutorActor.start(make_runner, 1, make_probe())
