"""Worker groups across processes, on fake runners: the wire round-trips the step messages, a
step reaches every rank as one encoding, a lost rank restarts all of them, a rank's load error
raises in the caller and leaves no process behind."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from actorlm.actors.executor import ExecutorActor
from actorlm.executors.wire import WireCodec, WorkerCall, WorkerReply
from actorlm.messages import (CachedRequestData, GetStats, GrammarBitmask, NewRequestData,
                              PositionLogprobs, PromptLogprobs, ScheduleStep, StepResult)
from actorlm.sampling_params import SamplingParams, StructuredOutputsParams
from actorlm.testing import FakeRunnerFactory


def new_request(rid: str, prompt: list[int], params: SamplingParams | None = None):
    return NewRequestData(rid, prompt, len(prompt), [[0]], 0, params or SamplingParams(), seed=7)


def test_a_step_with_sampling_params_round_trips_typed():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=9, seed=3,
                            stop=["\n"], stop_token_ids=[5], logit_bias={12: -1.5},
                            logprobs=2, prompt_logprobs=1, bad_words=["x"],
                            structured_outputs=StructuredOutputsParams(regex="a+"))
    step = ScheduleStep(4, [new_request("a", [1, 2, 3], params)],
                        [CachedRequestData("b", [[9]], 17)], [3, 1], ["z"], ["a"])
    codec = WireCodec()
    call = codec.decode_call(codec.encode_step(step))
    assert call == WorkerCall(step=step) and not call.shutdown
    assert isinstance(call.step.new_requests[0].sampling_params, SamplingParams)
    assert call.step.new_requests[0].sampling_params == params
    bitmask = GrammarBitmask(4, ["a"], b"\xff\x00\x00\x01" * 3)
    assert codec.decode_call(codec.encode_bitmask(bitmask)).bitmask == bitmask
    result = StepResult(4, ["a", "b"], [11, 12],
                        logprobs=[PositionLogprobs([11, 3], [-0.5, -1.25], 1), None],
                        prompt_logprobs=[PromptLogprobs("a", 1, [PositionLogprobs([2], [-2.0],
                                                                                  4)])],
                        timings=[0.001, 0.002, 0.003])
    assert codec.decode_reply(codec.encode_reply(WorkerReply(result=result))).result == result
    with pytest.raises(Exception, match="Expected"):
        codec.decode_reply(codec.encode_step(step))  # typed: a call is no reply


def step(step_id: int, new=(), cached=(), finished=()) -> ScheduleStep:
    return ScheduleStep(step_id, list(new), list(cached),
                        [len(r.token_ids) for r in new] + [1] * len(cached), list(finished))


@pytest.fixture
def new_children():
    """This process's live children that the test started: not those running before it (a
    Ray cluster that a session-wide fixture of another module has started, say)."""
    before = {p.pid for p in psutil.Process().children()}
    return lambda: [p for p in psutil.Process().children() if p.pid not in before and
                    p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("num_ranks", [1, 2])
def test_a_killed_rank_restarts_every_rank_and_its_step_faults(make_probe, num_ranks,
                                                               new_children):
    scheduler = make_probe("scheduler")
    executor = ExecutorActor.start(FakeRunnerFactory(), num_ranks, scheduler.ref, backend="mp")
    try:
        stats = executor.ask(GetStats())
        pids = stats.worker_pids
        assert len(pids) == num_ranks and os.getpid() not in pids
        executor.tell(step(1, new=[new_request("a", [1, 2, 3])]))
        first = scheduler.expect_message(StepResult)
        assert first.request_ids == ["a"] and first.fault is None
        assert len(first.rank_timings) == num_ranks
        os.kill(pids[-1], signal.SIGKILL)
        # a rank lost between steps: the next step faults, blaming no request
        time.sleep(0.5)
        executor.tell(step(2, cached=[CachedRequestData("a", [], 3)]))
        faulted = scheduler.expect_message(StepResult, timeout=2.0)
        assert faulted.fault and "SIGKILL" in faulted.fault and faulted.blame_request_ids == []
        # the scheduler recomputes: the restarted ranks get the request in full
        executor.tell(step(3, new=[new_request("a", [1, 2, 3])]))
        again = scheduler.expect_message(StepResult, timeout=30.0)
        assert again.fault is None and again.sampled_token_ids == first.sampled_token_ids
        stats = executor.ask(GetStats())
        assert stats.num_worker_restarts == 1
        assert len(stats.worker_pids) == num_ranks and not set(stats.worker_pids) & set(pids)
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() !=
                       psutil.STATUS_ZOMBIE for pid in pids)  # the survivors were killed too
    finally:
        executor.stop()
    assert new_children() == []


def test_a_rank_that_cannot_load_raises_in_the_caller_and_leaves_no_process(make_probe,
                                                                             new_children):
    with pytest.raises(ValueError, match="rank 1: no such checkpoint") as raised:
        ExecutorActor.start(FakeRunnerFactory(fail_rank=1), 2, make_probe().ref, backend="mp")
    assert "worker process 1" in "".join(getattr(raised.value, "__notes__", []))
    assert new_children() == []

