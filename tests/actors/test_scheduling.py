"""Scheduling through the real actors, one step at a time (EngineHarness + FakeModelRunner).

No model, no sleeps: the harness delivers every message itself and time is a ManualClock.
"""

import pytest

from actorlm.fsm import RequestEvent, RequestState


def prompt(n, start=3):
    return [start + (7 * i) % 90 for i in range(n)]


def step_until(h, condition, max_steps=200):
    for _ in range(max_steps):
        if condition():
            return
        assert h.step() is not None, "the engine went idle first"
    raise AssertionError(f"not reached in {max_steps} steps")


def expected(h, rid):
    """What an unpressured greedy run produces: the fake model is a pure function of
    (prompt, position)."""
    record = h.requests[rid]
    return h.runner.expected_tokens(record.prompt_token_ids, len(record.output_token_ids))


# --- budgets -------------------------------------------------------------------------------------


def test_token_budget_and_max_num_seqs_hold_every_step(make_harness):
    h = make_harness(max_num_batched_tokens=24, max_num_seqs=3, num_kv_blocks=128)
    ids = [h.add_request(prompt(5 + 3 * i, start=i), max_tokens=6) for i in range(7)]
    records = h.run_until_idle()
    assert all(r.num_tokens <= 24 and r.num_seqs <= 3 for r in records)
    assert any(r.num_tokens == 24 for r in records)  # the budget was binding, not slack
    assert any(r.num_seqs == 3 for r in records)
    assert max(len(r.transitions) for r in records) > 0
    for rid in ids:
        record = h.requests[rid]
        assert (record.finish_reason, len(record.output_token_ids)) == ("length", 6)
        assert record.output_token_ids == expected(h, rid)
        assert h.output(rid).outputs[0].token_ids == record.output_token_ids
    h.check_invariants()


def test_step_runs_exactly_one_step_and_reports_it(make_harness):
    h = make_harness(max_num_batched_tokens=8)
    rid = h.add_request(prompt(10), max_tokens=2)
    assert h.pending_step is not None and h.pending_step.num_scheduled_tokens == [8]
    assert h.requests[rid].state is RequestState.RUNNING
    first = h.step()
    assert first.scheduled == {rid: 8} and first.new_tokens == {} and first.result.request_ids == []
    assert h.pending_step.num_scheduled_tokens == [2]  # the rest of the prompt, planned, held
    second = h.step()
    assert second.scheduled == {rid: 2} and second.new_tokens == {rid: expected(h, rid)}
    third = h.step()
    assert third.finished == {rid: "length"} and [t[2] for t in third.transitions] == \
        [RequestEvent.FINISH]
    assert h.step() is None and h.pending_step is None
    assert h.scheduled_steps == [first.step, second.step, third.step]
    h.check_invariants()


# --- chunked prefill -----------------------------------------------------------------------------


def test_chunked_prefill_splits_a_long_prompt_and_keeps_decoding(make_harness):
    h = make_harness(max_num_batched_tokens=16, max_model_len=128, num_kv_blocks=64)
    short = h.add_request(prompt(4), max_tokens=20)
    long = h.add_request(prompt(50, start=11), max_tokens=2)  # joins the next plan
    h.step()  # short prefills alone
    chunks = []
    while not h.requests[long].output_token_ids:  # its first token ends the prefill
        assert len(chunks) < 10
        record = h.step()
        chunks.append(record.scheduled[long])
        assert record.scheduled[short] == 1  # the decode is served first, every step
    assert chunks == [15, 15, 15, 5]
    h.run_until_idle()
    assert h.requests[long].output_token_ids == expected(h, long)
    assert h.requests[short].output_token_ids == expected(h, short)
    h.check_invariants()


def test_without_chunked_prefill_a_prompt_waits_for_room_for_all_of_it(make_harness):
    h = make_harness(max_num_batched_tokens=40, max_model_len=40, enable_chunked_prefill=False,
                     num_kv_blocks=64)
    running = [h.add_request(prompt(4, start=i), max_tokens=30) for i in range(3)]
    big = h.add_request(prompt(38, start=50), max_tokens=2)
    records = h.run_until_idle()
    scheduled_big = [r.scheduled[big] for r in records if big in r.scheduled]
    assert scheduled_big[0] == 38  # whole, never chunked
    assert all(r.num_tokens <= 40 for r in records)
    for rid in running + [big]:
        assert h.requests[rid].output_token_ids == expected(h, rid)
    h.check_invariants()


# --- preemption ----------------------------------------------------------------------------------


def run_batch(make_harness, num_kv_blocks):
    h = make_harness(num_kv_blocks=num_kv_blocks, block_size=4, max_num_batched_tokens=64,
                     max_model_len=64)
    ids = [h.add_request(prompt(6 + i, start=i), max_tokens=24, ignore_eos=True)
           for i in range(6)]
    return h, ids, h.run_until_idle()


def test_kv_exhaustion_preempts_the_newest_and_recomputes_the_same_tokens(make_harness):
    roomy, ids, _ = run_batch(make_harness, 64)
    tight, _, records = run_batch(make_harness, 16)
    assert sum(roomy.requests[rid].num_preemptions for rid in ids) == 0
    assert sum(tight.requests[rid].num_preemptions for rid in ids) > 0
    for rid in ids:
        assert tight.requests[rid].output_token_ids == roomy.requests[rid].output_token_ids
        assert tight.requests[rid].finish_reason == "length"
    # replay the transitions: every victim is the newest running request at that moment
    running, victims = [], []
    for rid, _, event, _ in tight.transitions:
        if event is RequestEvent.SCHEDULE:
            running.append(rid)
        elif event is RequestEvent.PREEMPT:
            assert rid == running[-1], f"preempted {rid}, newest was {running[-1]}"
            victims.append(running.pop())
        else:
            running.remove(rid)
    for record in records:
        if record.preempted_ids:  # no request is admitted in a step that preempted
            admitted = [rid for rid, _, event, _ in record.transitions
                        if event is RequestEvent.SCHEDULE]
            assert not admitted
    assert victims
    tight.check_invariants()


def test_a_step_that_preempts_admits_no_one(make_harness):
    # a small budget makes the victim's first chunk cheap: admitting it again at once would
    # fit, and would only take the blocks back
    h = make_harness(num_kv_blocks=6, block_size=4, max_num_batched_tokens=4, max_model_len=24)
    ids = [h.add_request(prompt(7, start=s), max_tokens=12, ignore_eos=True) for s in (0, 40)]
    records = h.run_until_idle()
    preempting = [r for r in records if r.preempted_ids]
    assert preempting
    for record in preempting:
        assert not [t for t in record.transitions if t[2] is RequestEvent.SCHEDULE], \
            f"admitted in a step that preempted: {record.transitions}"
    for rid in ids:
        assert h.requests[rid].output_token_ids == expected(h, rid)
    h.check_invariants()


# --- aborts --------------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["waiting", "running", "preempted"])
def test_abort_in_each_state_frees_every_block(make_harness, when):
    h = make_harness(num_kv_blocks=6, block_size=4, max_num_batched_tokens=64, max_model_len=24)
    old = h.add_request(prompt(7), max_tokens=12, ignore_eos=True)
    new = h.add_request(prompt(7, start=40), max_tokens=12, ignore_eos=True)
    if when == "waiting":
        target = h.add_request(prompt(3, start=70), max_tokens=4)
    elif when == "running":
        h.step()
        target = old
    else:
        step_until(h, lambda: h.requests[new].state is RequestState.PREEMPTED)
        target = new
    assert h.requests[target].state is RequestState[when.upper()]
    h.abort(target)
    h.run_until_idle()
    record = h.requests[target]
    assert record.state is RequestState.FINISHED and record.finish_reason == "abort"
    assert record.transitions[-1][1] is RequestEvent.ABORT
    assert h.output(target).outputs[0].finish_reason == "abort"
    survivor = new if target == old else old
    assert h.requests[survivor].output_token_ids == expected(h, survivor)
    assert len(h.requests[survivor].output_token_ids) == 12
    kv = h.kv_stats()
    assert kv.num_free_blocks == kv.num_total_blocks == 6 and kv.num_requests_holding_blocks == 0
    h.check_invariants()


def test_abort_of_unknown_or_finished_ids_changes_nothing(make_harness):
    h = make_harness()
    rid = h.add_request(prompt(5), max_tokens=2)
    h.run_until_idle()
    h.abort(rid, "no-such-request")
    assert h.requests[rid].finish_reason == "length" and h.requests[rid].num_finish_deltas == 1
    assert h.step() is None
    h.check_invariants()


def test_aborts_wait_for_the_pending_step(make_harness):
    h = make_harness(max_num_seqs=1)
    first = h.add_request(prompt(5), max_tokens=3)
    second = h.add_request(prompt(5, start=30), max_tokens=3)
    h.abort(first, second)  # the pending step holds `first`; both wait for it
    assert h.requests[second].state is RequestState.WAITING
    h.step()
    assert h.requests[second].finish_reason == "abort"
    assert h.requests[first].finish_reason == "abort"
    assert h.pending_step is None and h.num_free_blocks == h.num_total_blocks
    h.check_invariants()


# --- faults --------------------------------------------------------------------------------------


def test_a_request_fault_fails_only_that_request(make_harness):
    h = make_harness()
    a, b, c = (h.add_request(prompt(5, start=s), max_tokens=6) for s in (1, 30, 60))
    h.step()  # a prefills; b and c join the next step
    h.runner.fail_request(b, "bad row")
    record = h.step()
    assert set(record.scheduled) == {a, b, c}
    assert record.result.failed_request_ids == [b]
    assert set(record.new_tokens) == {a, c}  # the others of the same step got their tokens
    assert record.finished == {b: "error"}
    assert "bad row" in h.requests[b].error and h.output(b).error
    h.run_until_idle()
    for rid in (a, c):
        assert h.requests[rid].output_token_ids == expected(h, rid)
        assert len(h.requests[rid].output_token_ids) == 6
    later = h.add_request(prompt(4, start=5), max_tokens=3)  # still serving
    h.run_until_idle()
    assert h.requests[later].finish_reason == "length"
    h.check_invariants()


def test_a_failed_request_after_preemption_leaves_no_block_behind(make_harness):
    h = make_harness(num_kv_blocks=6, block_size=4, max_num_batched_tokens=64, max_model_len=24)
    old = h.add_request(prompt(7), max_tokens=12, ignore_eos=True)
    new = h.add_request(prompt(7, start=40), max_tokens=12, ignore_eos=True)
    step_until(h, lambda: h.requests[new].num_preemptions > 0)
    h.runner.fail_request(new)  # fails when it is recomputed
    h.run_until_idle()
    assert h.requests[new].finish_reason == "error"
    assert h.requests[old].output_token_ids == expected(h, old)
    h.check_invariants()


# --- finish reasons ------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", ["eos", "stop_token", "max_tokens", "max_model_len",
                                  "ignore_eos"])
def test_finish_reasons(make_harness, stop):
    p = prompt(6)
    probe_run = make_harness(max_model_len=16)
    tokens = probe_run.runner.expected_tokens(p, 10)
    eos = tokens[3]
    h = make_harness(max_model_len=16, eos_token_ids=[eos])
    params = {"eos": dict(max_tokens=30),
              "stop_token": dict(max_tokens=30, ignore_eos=True, stop_token_ids=[tokens[2]]),
              "max_tokens": dict(max_tokens=3),
              "max_model_len": dict(max_tokens=30, ignore_eos=True),
              "ignore_eos": dict(max_tokens=6, ignore_eos=True)}[stop]
    rid = h.add_request(p, **params)
    h.run_until_idle()
    record = h.requests[rid]
    want = {"eos": (4, "stop", None), "stop_token": (3, "stop", tokens[2]),
            "max_tokens": (3, "length", None), "max_model_len": (10, "length", None),
            "ignore_eos": (6, "length", None)}[stop]
    assert (len(record.output_token_ids), record.finish_reason, record.stop_reason) == want
    assert record.output_token_ids == tokens[:want[0]]
    final = h.output(rid).outputs[0]
    assert (final.finish_reason, final.token_ids) == (want[1], record.output_token_ids)
    h.check_invariants()


# --- time and input ------------------------------------------------------------------------------


def test_time_comes_from_the_manual_clock(make_harness, clock):
    h = make_harness(max_num_batched_tokens=8)
    h.runner.step_latency = 0.25
    clock.advance(10.0)
    rid = h.add_request(prompt(12), max_tokens=3)
    records = h.run_until_idle()
    record = h.requests[rid]
    assert record.arrival_time == 10.0  # stamped by the frontend from the clock
    # 12 prompt tokens in chunks of 8: the first token comes with the second step
    assert record.first_token_time == 10.5
    assert record.finish_time == 10.0 + 0.25 * len(records) == 11.0
    assert [r.time for r in records] == [10.25, 10.5, 10.75, 11.0]


def test_bad_input_is_refused_before_anything_is_allocated(make_harness):
    h = make_harness(max_model_len=16, vocab_size=100)
    with pytest.raises(ValueError, match="maximum context length"):
        h.add_request(prompt(17))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        h.add_request([5, 100])
    assert h.pending_step is None and h.num_free_blocks == h.num_total_blocks
    rid = h.add_request(prompt(5), max_tokens=2)
    h.run_until_idle()
    assert h.requests[rid].finish_reason == "length"
    h.check_invariants()


def test_text_prompts_go_through_the_toy_tokenizer(make_harness):
    h = make_harness()
    rid = h.add_request("t5 t6 t7", max_tokens=3)
    h.run_until_idle()
    assert h.requests[rid].prompt_token_ids == [5, 6, 7]
    out = h.output(rid).outputs[0]
    assert out.text == h.tokenizer.decode(out.token_ids)


def test_parallel_sampling_children_share_the_prompt_and_free_everything(make_harness):
    h = make_harness(num_kv_blocks=32, block_size=4)
    rid = h.add_request(prompt(10), n=3, temperature=1.0, max_tokens=5)
    h.run_until_idle()
    completions = h.output(rid).outputs
    assert len(completions) == 3
    assert all(c.finish_reason == "length" and len(c.token_ids) == 5 for c in completions)
    assert len({tuple(c.token_ids) for c in completions}) == 3  # seeds differ per child
    assert len(h.requests) == 3 and all(r.is_finished for r in h.requests.values())
    h.check_invariants()  # includes the KV oracle: children read the shared prompt blocks
