"""The SchedulerActor alone: TestProbes play its frontend, allocator and executor, and the test
plays the allocator's and executor's replies, asserting the exact message sequence."""

import pytest

from actorlm.actors.scheduler import SchedulerActor
from actorlm.core.scheduler import Scheduler, SchedulerConfig
from actorlm.messages import (AbortRequests, AddRequest, Admitted, AllocateSlots, Connect,
                              EngineOutputs, GetStats, ScheduleStep, SlotsGranted, StepResult)
from actorlm.sampling_params import SamplingParams


@pytest.fixture
def wired(make_probe):
    frontend, allocator, executor = make_probe("frontend"), make_probe("allocator"), \
        make_probe("executor")
    policy = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4,
                                       max_model_len=32, block_size=4))
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
    assert (ask.step_id, ask.free_request_ids, ask.request_ids) == (0, [], [])
    [candidate] = ask.candidates
    assert (candidate.request_id, candidate.num_tokens, candidate.max_new_tokens) == ("a", 6, 6)
    assert len(candidate.block_hashes) == 1  # the block of the last token is never a hit
    quiet(scheduler, frontend, executor)  # nothing runs before the grant

    scheduler.tell(SlotsGranted(0, [], [], [Admitted("a", [[5, 6]], 0, 6)], 6, 0))
    step = executor.expect_message(ScheduleStep)
    assert step.step_id == 0 and step.num_scheduled_tokens == [6]
    [new] = step.new_requests
    assert (new.request_id, new.block_ids, new.num_computed_tokens) == ("a", [[5, 6]], 0)

    scheduler.tell(StepResult(0, ["a"], [42]))
    # the next plan is sent before the outputs (blocks before callers), one message each
    ask = allocator.expect_message(AllocateSlots)
    assert (ask.step_id, ask.request_ids, ask.num_tokens) == (1, ["a"], [7])
    assert ask.num_computed_tokens == [6]  # where a sliding window would start
    # the step completed a's first block: it enters the prefix cache
    assert [(c.request_id, c.first_block, len(c.block_hashes)) for c in ask.computed_blocks] \
        == [("a", 0, 1)]
    out = frontend.expect_message(EngineOutputs)
    assert [(d.request_id, d.new_token_ids, d.finish_reason) for d in out.deltas] == \
        [("a", [42], None)]

    scheduler.tell(SlotsGranted(1, [[]], [], [], 6, 0))
    step = executor.expect_message(ScheduleStep)
    assert step.new_requests == [] and step.num_scheduled_tokens == [1]
    assert [(c.request_id, c.num_computed_tokens) for c in step.cached_requests] == [("a", 6)]

    scheduler.tell(StepResult(1, ["a"], [43]))  # max_tokens=2: finished
    ask = allocator.expect_message(AllocateSlots)
    assert (ask.free_request_ids, ask.request_ids) == (["a"], [])  # its blocks go back
    out = frontend.expect_message(EngineOutputs)
    assert [(d.request_id, d.new_token_ids, d.finish_reason) for d in out.deltas] == \
        [("a", [43], "length")]
    scheduler.tell(SlotsGranted(2, [], [], [], 8, 1))
    quiet(scheduler, frontend, allocator, executor)  # idle: no more steps, no polling


def test_an_abort_during_a_step_waits_for_its_result(wired):
    scheduler, frontend, allocator, executor = wired
    scheduler.tell(add("a", 5, max_tokens=8))
    allocator.expect_message(AllocateSlots)
    scheduler.tell(SlotsGranted(0, [], [], [Admitted("a", [[0, 1]], 0, 5)], 6, 0))
    executor.expect_message(ScheduleStep)

    scheduler.tell(AbortRequests(["a"]))
    quiet(scheduler, frontend, allocator)  # deferred: the step's requests do not change under it

    scheduler.tell(StepResult(0, ["a"], [7]))
    ask = allocator.expect_message(AllocateSlots)
    assert (ask.free_request_ids, ask.request_ids) == (["a"], [])
    out = frontend.expect_message(EngineOutputs)
    assert [(d.request_id, d.new_token_ids, d.finish_reason) for d in out.deltas] == \
        [("a", [7], None), ("a", [], "abort")]
    scheduler.tell(SlotsGranted(1, [], [], [], 8, 1))
    quiet(scheduler, frontend, allocator, executor)


def test_the_allocators_preemption_and_admission_decide_the_step(wired):
    scheduler, frontend, allocator, executor = wired
    scheduler.tell(add("a", 4, max_tokens=8))
    allocator.expect_message(AllocateSlots)
    scheduler.tell(SlotsGranted(0, [], [], [Admitted("a", [[0]], 0, 4)], 7, 0))
    executor.expect_message(ScheduleStep)
    scheduler.tell(add("b", 4, max_tokens=8))
    scheduler.tell(StepResult(0, ["a"], [9]))
    ask = allocator.expect_message(AllocateSlots)
    assert ask.request_ids == ["a"] and [c.request_id for c in ask.candidates] == ["b"]
    # the allocator preempts a (it had no room) and so admits no one: nothing runs
    scheduler.tell(SlotsGranted(1, [], ["a"], [], 8, 1))
    ask = allocator.expect_message(AllocateSlots)  # at once: the next proposal
    assert ask.request_ids == [] and [c.request_id for c in ask.candidates] == ["a", "b"]
    stats = scheduler.ask(GetStats())
    assert (stats.num_running, stats.num_waiting, stats.num_preemptions) == (0, 2, 1)
    # a comes back at its cache hit: only its newest token is computed
    scheduler.tell(SlotsGranted(2, [], [], [Admitted("a", [[3, 4]], 4, 1)], 6, 0))
    step = executor.expect_message(ScheduleStep)
    [new] = step.new_requests
    assert (new.request_id, new.token_ids, new.num_computed_tokens, step.num_scheduled_tokens) \
        == ("a", [3, 4, 5, 6, 9], 4, [1])


def test_a_suspect_runs_alone_for_a_step_and_the_frontend_hears_before_and_after(wired):
    """A request resumed after engine-core deaths (``suspect``) runs alone for one step: the
    frontend is told before the step goes out (the core may not survive it) and once it has
    ended; then the suspect rejoins the batch."""
    import msgspec

    scheduler, frontend, allocator, executor = wired
    scheduler.tell(add("a", 3, max_tokens=4))
    allocator.expect_message(AllocateSlots)
    scheduler.tell(SlotsGranted(0, [], [], [Admitted("a", [[1]], 0, 3)], 6, 0))
    executor.expect_message(ScheduleStep)
    scheduler.tell(msgspec.structs.replace(add("s", 3, max_tokens=4), suspect=True))
    scheduler.tell(StepResult(0, ["a"], [42]))
    ask = allocator.expect_message(AllocateSlots)
    # the suspect alone: a makes room (preempted, its blocks freed)
    assert (ask.request_ids, ask.free_request_ids) == ([], ["a"])
    assert [c.request_id for c in ask.candidates] == ["s"]
    frontend.expect_message(EngineOutputs)  # a's token
    scheduler.tell(SlotsGranted(1, [], [], [Admitted("s", [[2]], 0, 3)], 6, 0))
    notice = frontend.expect_message(EngineOutputs)
    assert (notice.step_id, notice.deltas, notice.on_trial) == (1, [], ["s"])
    step = executor.expect_message(ScheduleStep)
    assert step.request_ids == ["s"]
    scheduler.tell(StepResult(1, ["s"], [50]))
    ask = allocator.expect_message(AllocateSlots)
    assert sorted(c.request_id for c in ask.candidates) == ["a"] and ask.request_ids == ["s"]
    over = frontend.expect_message(EngineOutputs)
    assert over.trial_over == ["s"] and over.on_trial == []
