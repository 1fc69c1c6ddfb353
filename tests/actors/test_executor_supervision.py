"""The executor's supervision of its workers, without actors: ``WorkerSupervision`` on a fake
group, its callables wired to lists; then ``GroupStarter``, the one piece with a thread."""

from __future__ import annotations

import queue
import threading

import msgspec
import pytest

from actorlm.executors.group_starter import GroupStarter
from actorlm.executors.supervision import WorkerSupervision
from actorlm.messages import (CachedRequestData, GrammarBitmask, ScheduleStep, StepResult,
                              WorkerFailed, WorkerRestarted, WorkerResult)

EXECUTOR = "executor"  # the address the ranks report to: opaque to the supervision


class FakeGroup:
    """Records what the supervision asks of it, in order."""

    def __init__(self, pids=()):
        self.pids = list(pids)
        self.calls: list[tuple] = []

    def attach(self, executor) -> None:
        self.calls.append(("attach", executor))

    def send_step(self, step: ScheduleStep) -> None:
        self.calls.append(("step", step.step_id))

    def send_bitmask(self, bitmask: GrammarBitmask) -> None:
        self.calls.append(("bitmask", bitmask.step_id))

    def stop(self, kill: bool = False) -> None:
        self.calls.append(("stop", kill))


class Executor:
    """A ``WorkerSupervision`` of ``num_workers`` ranks whose first group is attached."""

    def __init__(self, num_workers: int = 2):
        self.group = FakeGroup(pids=[101, 102])
        self.to_scheduler: list[StepResult] = []
        self.started: list[int] = []  # the generations start_group was asked for
        self.supervision = WorkerSupervision(self.group, num_workers, EXECUTOR,
                                             self.to_scheduler.append, self.started.append)
        self.supervision.attach()

    def answer(self, step: ScheduleStep, ranks=(0, 1)) -> None:
        for rank in ranks:
            self.supervision.on_worker_result(WorkerResult(rank, result(step, rank)))

    def restart(self, generation: int = 1) -> FakeGroup:
        new = FakeGroup(pids=[201, 202])
        self.supervision.on_restarted(WorkerRestarted(generation, new))
        return new


def step(step_id: int, *request_ids: str) -> ScheduleStep:
    cached = [CachedRequestData(rid, [], 4) for rid in request_ids]
    return ScheduleStep(step_id, [], cached, [1] * len(cached), [])


def result(s: ScheduleStep, rank: int) -> StepResult:
    # with tensor parallelism only rank 0 samples
    tokens = [7] * len(s.request_ids) if rank == 0 else []
    return StepResult(s.step_id, s.request_ids if rank == 0 else [], tokens,
                      timings=[0.1 * rank, 0.2, 0.3])


def bitmask(step_id: int) -> GrammarBitmask:
    return GrammarBitmask(step_id, ["a"], b"\xff\x00\x00\x00")


def test_a_step_answered_by_every_rank_forwards_rank_0s_result_with_every_ranks_timings():
    e = Executor()
    first = step(1, "a", "b")
    e.supervision.on_step(first)
    assert e.group.calls == [("attach", EXECUTOR), ("step", 1)]
    e.answer(first, ranks=[1])
    assert e.to_scheduler == []  # rank 0 has not answered yet
    e.answer(first, ranks=[0])
    expected = msgspec.structs.replace(result(first, 0), rank_timings=[[0.0, 0.2, 0.3],
                                                                       [0.1, 0.2, 0.3]])
    assert e.to_scheduler == [expected]
    e.answer(first, ranks=[0])  # a step answered already: nothing more
    assert e.to_scheduler == [expected]
    assert e.supervision.stats().worker_pids == [101, 102]
    assert e.started == [] and e.supervision.num_restarts == 0


def test_a_bitmask_follows_its_step_to_the_ranks():
    e = Executor()
    e.supervision.on_step(step(1, "a"))
    e.supervision.on_bitmask(bitmask(1))
    e.supervision.on_bitmask(bitmask(0))  # not the step the ranks run
    assert e.group.calls[1:] == [("step", 1), ("bitmask", 1)]


def test_a_worker_failure_mid_step_faults_it_blaming_its_requests_and_restarts_the_group():
    e = Executor()
    e.supervision.on_step(step(1, "a", "b"))
    e.supervision.on_worker_failed(WorkerFailed(1, 0, "RuntimeError: device lost"))
    [fault] = e.to_scheduler
    assert fault.step_id == 1 and fault.sampled_token_ids == []
    assert fault.fault == "worker 1: RuntimeError: device lost"
    assert fault.blame_request_ids == ["a", "b"]
    assert e.group.calls[-1] == ("stop", True)  # every rank: the survivors too
    assert e.started == [1] and e.supervision.generation == 1
    assert e.supervision.group is None and e.supervision.workers == []
    assert e.supervision.stats().num_worker_restarts == 1
    assert e.supervision.stats().worker_pids == []


def test_a_failure_between_steps_faults_the_next_step_blaming_no_one():
    e = Executor()
    first = step(1, "a")
    e.supervision.on_step(first)
    e.answer(first)
    e.supervision.on_worker_failed(WorkerFailed(0, 0, "its thread stopped"))
    assert len(e.to_scheduler) == 1 and e.started == [1]  # nothing to fault yet
    new = e.restart()
    e.supervision.on_step(step(2, "a"))  # planned as if the ranks still held "a"
    fault = e.to_scheduler[-1]
    assert fault.step_id == 2 and fault.blame_request_ids == []
    assert fault.fault == ("the workers were restarted since the last step: "
                           "worker 0: its thread stopped")
    e.supervision.on_step(step(3, "a"))  # recomputed: this one runs
    assert new.calls == [("attach", EXECUTOR), ("step", 3)]


def test_a_step_that_arrives_while_a_group_starts_is_held_then_dispatched_with_its_bitmask():
    e = Executor()
    e.supervision.on_step(step(1, "a"))
    e.supervision.on_worker_failed(WorkerFailed(0, 0, "boom"))
    held = step(2, "a")
    e.supervision.on_step(held)
    e.supervision.on_bitmask(bitmask(2))
    assert len(e.to_scheduler) == 1  # only step 1's fault: step 2 waits
    new = e.restart()
    assert new.calls == [("attach", EXECUTOR), ("step", 2), ("bitmask", 2)]
    e.answer(held)
    assert e.to_scheduler[-1].step_id == 2 and e.to_scheduler[-1].fault is None


def test_a_bitmask_for_a_faulted_step_is_ignored():
    e = Executor()
    e.supervision.on_step(step(1, "a"))
    e.supervision.on_worker_failed(WorkerFailed(0, 0, "boom"))
    e.supervision.on_bitmask(bitmask(1))  # the step will be planned again, with its own
    new = e.restart()
    e.supervision.on_step(step(2, "a"))
    assert new.calls == [("attach", EXECUTOR), ("step", 2)]
    assert ("bitmask", 1) not in e.group.calls


def test_results_and_failures_from_an_old_generation_are_ignored():
    e = Executor()
    first = step(1, "a")
    e.supervision.on_step(first)
    e.supervision.on_worker_failed(WorkerFailed(1, 0, "boom"))
    e.supervision.on_worker_failed(WorkerFailed(0, 0, "its thread stopped"))  # a goodbye
    new = e.restart()
    e.supervision.on_step(step(2, "a"))
    e.answer(first)  # the old group's answer to the faulted step
    e.supervision.on_worker_failed(WorkerFailed(0, 0, "its thread stopped"))
    assert [r.step_id for r in e.to_scheduler] == [1]  # step 1's fault only
    assert e.started == [1] and e.supervision.num_restarts == 1
    assert e.supervision.group is new
    stale = FakeGroup()
    e.supervision.on_restarted(WorkerRestarted(0, stale))  # a generation given up on
    assert stale.calls == [("stop", True)] and e.supervision.group is new


def test_a_group_that_cannot_be_restarted_raises():
    e = Executor()
    e.supervision.on_worker_failed(WorkerFailed(0, 0, "boom"))
    with pytest.raises(RuntimeError, match="could not be restarted: ValueError: no checkpoint"):
        e.supervision.on_restarted(WorkerRestarted(1, error="ValueError: no checkpoint"))


def test_stop_stops_the_group_and_expects_its_ranks_goodbyes():
    e = Executor()
    e.supervision.stop()
    assert e.group.calls[-1] == ("stop", False)  # after a step in progress
    e.supervision.on_worker_failed(WorkerFailed(0, 0, "its thread stopped"))
    assert e.started == [] and e.to_scheduler == []


# --- GroupStarter: the restart thread ---------------------------------------------------------


class SlowGroup(FakeGroup):
    """A group whose start() waits for ``loaded`` (or raises ``error``)."""

    def __init__(self, error: Exception | None = None):
        super().__init__()
        self.loaded, self.stopped = threading.Event(), threading.Event()
        self.error = error
        self.started_on: threading.Thread | None = None

    def start(self) -> None:
        self.started_on = threading.current_thread()
        assert self.loaded.wait(5.0)
        if self.error is not None:
            raise self.error

    def stop(self, kill: bool = False) -> None:
        super().stop(kill)
        self.stopped.set()


def starter_for(group: SlowGroup) -> tuple[GroupStarter, queue.Queue]:
    delivered: queue.Queue = queue.Queue()
    return GroupStarter(lambda generation: group, delivered.put), delivered


def test_a_restarted_group_starts_on_a_thread_of_its_own_and_is_delivered():
    group = SlowGroup()
    starter, delivered = starter_for(group)
    starter.start(3)
    group.loaded.set()
    assert delivered.get(timeout=5.0) == WorkerRestarted(3, group)
    assert group.started_on is not threading.current_thread()
    starter.claim()
    starter.close()  # the executor owns it now: close leaves it alone
    assert group.calls == []


def test_a_group_that_fails_to_start_is_delivered_as_its_error():
    group = SlowGroup(error=ValueError("no checkpoint"))
    starter, delivered = starter_for(group)
    starter.start(1)
    group.loaded.set()
    assert delivered.get(timeout=5.0) == WorkerRestarted(1, error="ValueError: no checkpoint")


def test_stop_while_a_restart_is_in_flight_stops_the_new_group():
    group = SlowGroup()
    starter, delivered = starter_for(group)
    starter.start(1)
    starter.close()  # the executor stops while the group loads
    group.loaded.set()
    assert group.stopped.wait(5.0) and group.calls == [("stop", True)]
    assert delivered.empty()


def test_a_group_delivered_but_not_claimed_is_stopped_by_close():
    group = SlowGroup()
    starter, delivered = starter_for(group)
    starter.start(1)
    group.loaded.set()
    delivered.get(timeout=5.0)  # in the stopping executor's inbox, never to be read
    starter.close()
    assert group.calls == [("stop", False)]
