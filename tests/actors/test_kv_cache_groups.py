"""KV-cache groups through the real actors (EngineHarness + FakeModelRunner): a full and a
sliding-window group served by one block pool. The fake runner keeps a table per group and
reads back what each group's attention reads, so a block let go too early, handed to two
requests or written at the placeholder fails the step."""

import pytest

from actorlm.fsm import RequestEvent

WINDOW, BS = 8, 4


def prompt(n, start=3):
    return [start + (7 * i) % 90 for i in range(n)]


def test_a_full_and_a_sliding_group_finish_every_request_and_leak_nothing(make_harness):
    # 24 blocks a group would hold one 96-token request; 1 + 40 blocks hold a few of them
    h = make_harness(kv_cache_windows=(None, WINDOW), num_kv_blocks=1 + 40, block_size=BS,
                     max_model_len=96, max_num_batched_tokens=16, max_num_seqs=6)
    shared = prompt(21)
    ids = [h.add_request(shared + [60 + i], max_tokens=50, ignore_eos=True) for i in range(3)]
    ids.append(h.add_request(prompt(9, start=5), max_tokens=70, ignore_eos=True, n=2))
    ids.append(h.add_request(prompt(30, start=8), max_tokens=20, ignore_eos=True))
    bound = -(-WINDOW // BS) + 1
    num_decode_steps = 0
    while (record := h.step()) is not None:
        step = h.pending_step
        if step is not None and not step.new_requests and set(step.num_scheduled_tokens) == {1}:
            # every request decodes: its sliding group holds only its window's blocks
            kv = h.kv_stats()
            assert kv.num_used_blocks[1] <= bound * len(step.cached_requests), kv
            assert sum(kv.num_used_blocks) == kv.num_total_blocks - kv.num_free_blocks
            num_decode_steps += 1
        assert len(h.steps) < 2000
    h.check_invariants()  # no step over budget, every block back, the fake runner's checks
    assert num_decode_steps > 20
    for rid in [f"{i}_{ids[3]}" for i in range(2)] + ids[:3] + ids[4:]:
        record = h.requests[rid]
        expected = h.runner.expected_tokens(record.prompt_token_ids,
                                            len(record.output_token_ids))
        assert record.finish_reason == "length" and record.output_token_ids == expected
    assert any(event is RequestEvent.PREEMPT for _, _, event, _ in h.transitions)
    kv = h.kv_stats()
    assert kv.prefix_cache_hits > 0  # the shared prompt, in both groups
    assert kv.num_total_blocks == 40 and kv.num_used_blocks == [0, 0]


def test_an_abort_returns_every_groups_blocks(make_harness):
    h = make_harness(kv_cache_windows=(WINDOW, None), num_kv_blocks=1 + 48, block_size=BS,
                     max_model_len=64)
    rid = h.add_request(prompt(12), max_tokens=40, ignore_eos=True)
    for _ in range(20):
        h.step()
    assert h.kv_stats().num_used_blocks[0] < h.kv_stats().num_used_blocks[1]
    h.abort(rid)
    h.run_until_idle()
    h.check_invariants()
    assert h.requests[rid].finish_reason == "abort"
    assert h.kv_stats().num_free_blocks == 48


def test_a_pool_that_cannot_hold_one_sequence_in_every_group_is_refused(make_harness):
    # 16 blocks hold a 64-token sequence of one group; with a sliding group beside it, up to
    # 1 + 16 + 11 (its window and a 32-token chunk)
    with pytest.raises(ValueError, match="--num-kv-blocks") as info:
        make_harness(kv_cache_windows=(None, WINDOW), num_kv_blocks=27, block_size=BS,
                     max_model_len=64, max_num_batched_tokens=32)
    assert "28 blocks" in str(info.value)
    make_harness(kv_cache_windows=(None, WINDOW), num_kv_blocks=28, block_size=BS,
                 max_model_len=64, max_num_batched_tokens=32)
