"""A worker fault costs no request: the step is recomputed, the worker replaced; a poison request
fails alone. Through the real actors, stepped by the harness, on the fake runner and on the tiny
Llama (whose greedy tokens must equal a clean run's)."""

import pytest

from actorlm.core.scheduler import MAX_FAULTS, PROBATION_AFTER
from actorlm.fsm import RequestEvent
from actorlm.testing import EngineHarness, FaultInjector
from actorlm.trace import StepSummary, TraceRecorder, replay_trace


def prompt(n, start=3):
    return [start + (7 * i) % 90 for i in range(n)]


def expected(h, rid):
    record = h.requests[rid]
    return h.runner.expected_tokens(record.prompt_token_ids, len(record.output_token_ids))


def restarts(h) -> int:
    return h.system.executor_stats().num_worker_restarts


def test_a_step_that_raises_is_recomputed_and_every_request_completes(make_harness):
    faults = FaultInjector()
    h = make_harness(max_num_seqs=2, wrap_runner=faults.wrap)
    a, b, c = (h.add_request(prompt(5, start=s), max_tokens=4) for s in (1, 30, 60))
    h.step()
    faults.raise_at(faults.num_steps, "device lost")
    record = h.step()
    assert "device lost" in record.result.fault
    assert sorted(record.result.blame_request_ids) == sorted(record.scheduled) == sorted([a, b])
    assert record.finished == {} and record.new_tokens == {}
    preempts = {rid for rid, _, event, _ in record.transitions if event is RequestEvent.PREEMPT}
    assert preempts == {a, b}  # the workers lost them: both are recomputed
    h.run_until_idle()
    for rid in (a, b, c):
        assert h.requests[rid].finish_reason == "length"
        assert h.requests[rid].output_token_ids == expected(h, rid)
    assert restarts(h) == 1
    h.check_invariants()


def test_a_worker_whose_thread_dies_mid_step_is_replaced_and_nothing_is_lost(make_harness):
    faults = FaultInjector()
    h = make_harness(wrap_runner=faults.wrap)
    ids = [h.add_request(prompt(6, start=s), max_tokens=5) for s in (1, 30, 60)]
    h.step()
    worker = h.system.executor.proxy().workers.get()[0]
    faults.kill_at(faults.num_steps)
    record = h.step()
    assert "thread" in record.result.fault and not worker.is_alive()
    h.run_until_idle()
    assert all(h.requests[rid].output_token_ids == expected(h, rid) for rid in ids)
    assert h.system.executor.proxy().workers.get()[0].is_alive()
    assert restarts(h) == 1
    h.check_invariants()


def test_a_worker_lost_between_steps_fails_the_next_step_blaming_no_one(make_harness):
    h = make_harness()
    ids = [h.add_request(prompt(6, start=s), max_tokens=5) for s in (1, 30)]
    h.step()
    h.system.executor.proxy().workers.get()[0].stop()  # its thread ends while idle
    record = h.step()
    assert record.result.fault and record.result.blame_request_ids == []
    h.run_until_idle()
    assert all(h.requests[rid].output_token_ids == expected(h, rid) for rid in ids)
    assert all(h.requests[rid].num_preemptions == 1 for rid in ids)
    h.check_invariants()


def test_a_poison_request_fails_alone_after_running_alone(make_harness):
    faults = FaultInjector()
    trace = TraceRecorder()
    h = make_harness(wrap_runner=faults.wrap, max_num_seqs=4, trace=trace)
    ids = [h.add_request(prompt(6, start=s), max_tokens=6) for s in (1, 20, 40, 60)]
    poison = ids[2]
    faults.poison(poison)
    records = h.run_until_idle()
    assert h.requests[poison].finish_reason == "error"
    assert "faults on this request" in h.requests[poison].error
    assert "poisoned" in h.output(poison).error
    for rid in ids:
        if rid != poison:
            assert h.requests[rid].finish_reason == "length"
            assert h.requests[rid].output_token_ids == expected(h, rid)
    faulted = [r for r in records if r.result.fault]
    # twice in company, then alone: the third fault is its own
    assert len(faulted) == PROBATION_AFTER + 1 < MAX_FAULTS
    assert faulted[-1].result.blame_request_ids == [poison]
    assert all(poison in r.result.blame_request_ids for r in faulted)
    later = h.add_request(prompt(4, start=5), max_tokens=3)  # still serving
    h.run_until_idle()
    assert h.requests[later].finish_reason == "length"
    h.check_invariants()
    records = trace.records()
    summaries = [r for r in records if isinstance(r, StepSummary) and r.fault]
    assert [s.blamed_ids[-1:] for s in summaries][-1] == [poison]
    report = replay_trace(records)  # the faults replay as they happened
    assert report.matched, report.describe()


@pytest.mark.parametrize("fault", ["raise", "kill", "poison"])
def test_faults_on_the_real_model_keep_greedy_tokens_identical(tiny_llama_dir, fault):
    def run(faults):
        h = EngineHarness(model=str(tiny_llama_dir), dtype="float32", num_kv_blocks=64,
                          block_size=4, max_model_len=64, max_num_batched_tokens=24,
                          max_num_seqs=4, wrap_runner=faults.wrap if faults else None)
        try:
            prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,",
                       "def fibonacci(n):"]
            ids = [h.add_request(p, max_tokens=12, ignore_eos=True) for p in prompts]
            if faults is not None:
                arm = {"raise": faults.raise_at, "kill": faults.kill_at}.get(fault)
                if arm is not None:
                    for _ in range(4):  # mid-run: prefills done, decodes under way
                        h.step()
                    arm(faults.num_steps)
                else:
                    faults.poison(ids[1])
            h.run_until_idle()
            h.check_invariants()
            return {rid: (h.requests[rid].finish_reason, h.requests[rid].output_token_ids)
                    for rid in ids}, restarts(h)
        finally:
            h.close()

    clean, _ = run(None)
    faulted, num_restarts = run(FaultInjector())
    if fault == "poison":
        poison = sorted(clean)[1]
        assert faulted.pop(poison)[0] == "error"
        clean.pop(poison)
    assert faulted == clean
    assert num_restarts == (1 if fault != "poison" else PROBATION_AFTER + 1)
