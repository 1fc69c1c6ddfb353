"""FakeModelRunner on its own: the runner contract, determinism, faults, latency, the oracle."""

import pytest

from actorlm.messages import CachedRequestData, NewRequestData, ScheduleStep
from actorlm.sampling_params import SamplingParams
from actorlm.testing import (FakeModelRunner, FaultInjector, InjectedDeath, InjectedFault,
                             ManualClock)

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


def new(rid, token_ids, block_ids, num_prompt=None, computed=0, temperature=0.0, seed=0,
        more_tables=()):
    """``block_ids``: the table of the first KV-cache group; ``more_tables``: the others'."""
    return NewRequestData(request_id=rid, token_ids=list(token_ids),
                          num_prompt_tokens=num_prompt or len(token_ids),
                          block_ids=[list(block_ids), *map(list, more_tables)],
                          num_computed_tokens=computed, seed=seed,
                          sampling_params=SamplingParams(temperature=temperature))


def cached(rid, new_blocks, computed, more_groups=()):
    """``new_blocks``: the first group's new blocks; ``more_groups``: the others' (all
    empty: nothing new, sent as one empty list)."""
    groups = [list(new_blocks), *map(list, more_groups)]
    return CachedRequestData(rid, groups if any(groups) else [], computed)


def step(step_id, new_requests=(), cached=(), counts=(), finished=()):
    return ScheduleStep(step_id, list(new_requests), list(cached), list(counts), list(finished))


def decode(runner, rid, step_id, computed, new_blocks=()):
    return runner.execute(step(step_id, cached=[cached(rid, new_blocks, computed)], counts=[1]))


def test_a_request_samples_only_when_its_context_is_complete():
    runner = FakeModelRunner(block_size=4, num_blocks=16)
    first = runner.execute(step(0, [new("a", PROMPT, [0, 1])], counts=[5]))
    assert (first.request_ids, first.sampled_token_ids) == ([], [])  # mid-prefill
    second = runner.execute(step(1, cached=[cached("a", [], 5)], counts=[3]))
    third = decode(runner, "a", 2, 8, new_blocks=[2])
    assert second.request_ids == third.request_ids == ["a"]
    assert second.sampled_token_ids + third.sampled_token_ids == \
        runner.expected_tokens(PROMPT, 2)
    assert runner.violations == []


def test_tokens_do_not_depend_on_chunking_batching_or_recompute():
    whole = FakeModelRunner(block_size=4, num_blocks=16)
    tokens = [whole.execute(step(0, [new("a", PROMPT, [0, 1])], counts=[8])).sampled_token_ids[0]]
    tokens += decode(whole, "a", 1, 8, [2]).sampled_token_ids
    tokens += decode(whole, "a", 2, 9).sampled_token_ids

    other = FakeModelRunner(block_size=4, num_blocks=16)
    other.execute(step(0, [new("a", PROMPT, [5, 6]), new("b", [1, 2, 3], [7])], counts=[8, 3]))
    decode(other, "a", 1, 8, [8])
    # preempted: dropped, then recomputed in full (prompt + the output so far) in new blocks
    history = PROMPT + tokens[:2]
    redo = other.execute(step(2, [new("a", history, [1, 2, 3], num_prompt=8)], counts=[10],
                              finished=["a"]))
    assert redo.sampled_token_ids == [tokens[2]]
    assert whole.violations == other.violations == []


def test_sampled_requests_depend_on_their_seed_and_a_custom_token_fn_is_used():
    runner = FakeModelRunner()
    a = runner.execute(step(0, [new("a", PROMPT, [], temperature=1.0, seed=1),
                                new("b", PROMPT, [], temperature=1.0, seed=2),
                                new("c", PROMPT, [], temperature=0.0, seed=3)],
                            counts=[8, 8, 8]))
    assert a.sampled_token_ids[2] == runner.token_at(PROMPT, 8)
    assert a.sampled_token_ids[0] == runner.token_at(PROMPT, 8, seed=1) != \
        runner.token_at(PROMPT, 8, seed=2) == a.sampled_token_ids[1]
    custom = FakeModelRunner(token_fn=lambda prompt, position, seed: position)
    assert custom.execute(step(0, [new("a", PROMPT, [])], counts=[8])).sampled_token_ids == [8]


def test_step_latency_moves_the_clock():
    clock = ManualClock()
    runner = FakeModelRunner(clock=clock,
                             step_latency=lambda s: 0.001 * sum(s.num_scheduled_tokens))
    runner.execute(step(0, [new("a", PROMPT, [])], counts=[8]))
    assert clock.now() == 0.008


def test_the_fault_injector_raises_kills_and_poisons_on_cue_before_the_runner_sees_the_step():
    faults = FaultInjector()
    runner = FakeModelRunner()
    wrapped = faults.wrap(runner)
    faults.raise_at(1, "device lost")
    faults.kill_at(2)
    faults.poison("p")
    assert wrapped.execute(step(0, [new("a", PROMPT, [])], counts=[8])).request_ids == ["a"]
    with pytest.raises(InjectedFault, match="device lost"):
        wrapped.execute(step(1, [new("b", [1, 2], [])], counts=[2]))
    with pytest.raises(InjectedDeath):
        wrapped.execute(step(2, [new("b", [1, 2], [])], counts=[2]))
    with pytest.raises(InjectedFault, match="poisoned"):
        wrapped.execute(step(3, [new("b", [1, 2], []), new("p", [3], [])], counts=[2, 1]))
    assert set(runner.requests) == {"a"}  # faulted steps never reached the runner
    assert wrapped.execute(step(4, [new("b", [1, 2], [])], counts=[2])).request_ids == ["b"]
    assert faults.faulted_steps == [1, 2, 3] and faults.num_steps == 5
    assert wrapped.steps is runner.steps  # everything else is the wrapped runner's


def test_a_request_fault_spares_the_rest_of_the_step():
    runner = FakeModelRunner()
    runner.fail_request("b", "bad row")
    result = runner.execute(step(0, [new("a", PROMPT, []), new("b", [1, 2], []),
                                     new("c", [3, 4], [])], counts=[8, 2, 2]))
    assert result.request_ids == ["a", "c"] and result.failed_request_ids == ["b"]
    assert "bad row" in result.error and "b" not in runner.requests
    again = runner.execute(step(1, [new("b", [1, 2], [])], counts=[2]))  # one-shot
    assert again.request_ids == ["b"]


@pytest.mark.parametrize("fault", ["shared_block", "stale_count", "too_few_blocks",
                                   "unknown_cached", "not_dropped", "outside_pool"])
def test_the_oracle_catches_bookkeeping_faults(fault):
    runner = FakeModelRunner(block_size=4, num_blocks=8)
    runner.execute(step(0, [new("a", PROMPT, [0, 1])], counts=[8]))
    bad = {
        # b is given a's block 1 and overwrites it; a then reads b's tokens
        "shared_block": [step(1, [new("b", [1, 2, 3, 4], [1])], counts=[4]),
                         step(2, cached=[cached("a", [2], 8)], counts=[1])],
        "stale_count": [step(1, cached=[cached("a", [2], 7)], counts=[1])],
        "too_few_blocks": [step(1, cached=[cached("a", [], 8)], counts=[1])],
        "unknown_cached": [step(1, cached=[cached("zz", [], 0)], counts=[1])],
        "not_dropped": [step(1, [new("a", PROMPT, [3, 4])], counts=[8])],
        "outside_pool": [step(1, [new("b", [1, 2], [9])], counts=[2])],
    }[fault]
    results = [runner.execute(s) for s in bad]
    assert runner.violations, fault
    assert results[-1].failed_request_ids  # the faulty step fails instead of lying


def test_with_kv_cache_groups_each_group_reads_what_its_attention_reads():
    runner = FakeModelRunner(block_size=4, num_blocks=16, windows=(None, 4))
    # a: full-group blocks 1, 2 and sliding-group blocks 3, 4 (a block id is one page in any
    # group's layers: one slot space)
    runner.execute(step(0, [new("a", PROMPT, [1, 2], more_tables=[[3, 4]])], counts=[8]))
    # a's window (4 positions) has left its sliding block 3: b may overwrite it
    b = new("b", [1, 2, 3], [5], more_tables=[[3]])
    result = runner.execute(step(1, [b], [cached("a", [6], 8, [[7]])], counts=[3, 1]))
    assert result.request_ids == ["b", "a"] and runner.violations == []
    assert result.sampled_token_ids[1] == runner.expected_tokens(PROMPT, 2)[1]


@pytest.mark.parametrize("fault", ["full_block_reused", "window_block_reused", "placeholder",
                                   "tables_per_group"])
def test_the_oracle_catches_kv_cache_group_faults(fault):
    runner = FakeModelRunner(block_size=4, num_blocks=16, windows=(None, 4))
    runner.execute(step(0, [new("a", PROMPT, [1, 2], more_tables=[[3, 4]])], counts=[8]))
    a_next = cached("a", [6], 8, [[7]])
    steps = {
        # a's full group still reads block 1 (positions 0-3)
        "full_block_reused": [step(1, [new("b", [1, 2, 3], [1], more_tables=[[5]])], [a_next],
                                   counts=[3, 1])],
        # a query at 8 reads positions 5-7: sliding block 4 is still in the window
        "window_block_reused": [step(1, [new("b", [1, 2, 3], [5], more_tables=[[4]])],
                                     [a_next], counts=[3, 1])],
        "placeholder": [step(1, [new("b", [1, 2, 3], [5], more_tables=[[0]])], counts=[3])],
        "tables_per_group": [step(1, [new("b", [1, 2, 3], [5])], counts=[3])],
    }[fault]
    results = [runner.execute(s) for s in steps]
    assert runner.violations, fault
    assert results[-1].failed_request_ids
