"""The SchedulerActor alone: TestProbes play its frontend, allocator and executor, and the test
plays the allocator's and executor's replies, asserting the exact message sequence."""

import pytest

from actorlm.actors.scheduler import SchedulerActor
from actorlm.core.scheduler import Scheduler, SchedulerConfig
from actorlm.messages import (AbortRequests, AddRequest, AllocateSlots, Connect, EngineOutputs,
                              GetStats, ScheduleStep, SlotsGranted, SlotsRefused, StepResult)
from actorlm.sampling_params import SamplingParams


@pytest.fixture
def wired(make_probe):
    frontend, allocator, executor = make_probe("frontend"), make_probe("allocator"), \
        make_probe("executor")
    policy = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4,
                                       max_model_len=32, block_size=4), num_total_blocks=8)
    scheduler = SchedulerActor.start(policy)
    scheduler.tell(Connect(frontend.ref, allocator.ref, executor.ref))
    yield scheduler, frontend, allocator, executor
    scheduler.stop()


def add(request_id, prompt_len, max_tokens=2):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return AddRequest(request_id, list(range(3, 3 + prompt_len)), params, 0, 0.0)


def quiet(scheduler, *probes):
    """Once the scheduler has answered an ask, everything it sent before is recorded."""
    scheduler.ask(GetStats())
    for probe in probes:
        probe.expect_no_message(0)


def test_one_request_end_to_end_message_by_message(wired):
    scheduler, frontend, allocator, executor = wired
    scheduler.tell(add("a", 6, max_tokens=2))
    ask = allocator.expect_message(AllocateSlots)
    assert (ask.step_id, ask.free_request_ids, ask.request_ids, ask.num_new_blocks) == \
        (0, [], ["a"], [2])
    quiet(scheduler, frontend, executor)  # nothing runs before the grant

    scheduler.tell(SlotsGranted(0, ["a"], [[5, 6]], 6, 8))
    step = executor.expect_message(ScheduleStep)
    assert step.step_id == 0 and step.num_scheduled_tokens == [6]
    [new] = step.new_requests
    assert (new.request_id, new.block_ids, new.num_computed_tokens) == ("a", [5, 6], 0)

    scheduler.tell(StepResult(0, ["a"], [42]))
    # the next plan is sent before the outputs (blocks before callers), one message each
    ask = allocator.expect_message(AllocateSlots)
    assert (ask.step_id, ask.request_ids, ask.num_new_blocks) == (1, ["a"], [0])
    out = frontend.expect_message(EngineOutputs)
    assert [(d.request_id, d.new_token_ids, d.finish_reason) for d in out.deltas] == \
        [("a", [42], None)]

    scheduler.tell(SlotsGranted(1, ["a"], [[]], 6, 8))
    step = executor.expect_message(ScheduleStep)
    assert step.new_requests == [] and step.num_scheduled_tokens == [1]
    assert [(c.request_id, c.num_computed_tokens) for c in step.cached_requests] == [("a", 6)]

    scheduler.tell(StepResult(1, ["a"], [43]))  # max_tokens=2: finished
    ask = allocator.expect_message(AllocateSlots)
    assert (ask.free_request_ids, ask.request_ids) == (["a"], [])  # its blocks go back
    out = frontend.expect_message(EngineOutputs)
    assert [(d.request_id, d.new_token_ids, d.finish_reason) for d in out.deltas] == \
        [("a", [43], "length")]
    scheduler.tell(SlotsGranted(2, [], [], 8, 8))
    quiet(scheduler, frontend, allocator, executor)  # idle: no more steps, no polling


def test_an_abort_during_a_step_waits_for_its_result(wired):
    scheduler, frontend, allocator, executor = wired
    scheduler.tell(add("a", 5, max_tokens=8))
    allocator.expect_message(AllocateSlots)
    scheduler.tell(SlotsGranted(0, ["a"], [[0, 1]], 6, 8))
    executor.expect_message(ScheduleStep)

    scheduler.tell(AbortRequests(["a"]))
    quiet(scheduler, frontend, allocator)  # deferred: the step's requests do not change under it

    scheduler.tell(StepResult(0, ["a"], [7]))
    ask = allocator.expect_message(AllocateSlots)
    assert (ask.free_request_ids, ask.request_ids) == (["a"], [])
    out = frontend.expect_message(EngineOutputs)
    assert [(d.request_id, d.new_token_ids, d.finish_reason) for d in out.deltas] == \
        [("a", [7], None), ("a", [], "abort")]
    scheduler.tell(SlotsGranted(1, [], [], 8, 8))
    quiet(scheduler, frontend, allocator, executor)


def test_a_refused_grant_fails_only_the_plan_and_resynchronises(wired):
    scheduler, frontend, allocator, executor = wired
    scheduler.tell(add("a", 5))
    allocator.expect_message(AllocateSlots)
    scheduler.tell(SlotsRefused(0, "2 blocks asked, 0 free", 0))
    out = frontend.expect_message(EngineOutputs)
    [delta] = out.deltas
    assert (delta.request_id, delta.finish_reason) == ("a", "error")
    assert "KV allocation refused" in delta.error
    ask = allocator.expect_message(AllocateSlots)  # the failed request's (empty) blocks
    assert ask.free_request_ids == ["a"]
    stats = scheduler.ask(GetStats())
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, 0)
    executor.expect_no_message(0)
