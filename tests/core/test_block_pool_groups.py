"""The pool with KV-cache groups: a sliding-window group holds only its window's blocks, one
pool of ids serves every group, block 0 is the placeholder, and prefix hits suit every group."""

import pytest

from actorlm.core.block_hash import extend_block_hashes
from actorlm.core.block_pool import NULL_BLOCK, BlockPool, max_blocks_per_sequence
from actorlm.messages import AllocateSlots, Candidate, ComputedBlocks

BS = 4
FULL, WINDOW = None, 8  # a sliding group of 8 positions: 2 blocks before a block boundary


def hashes(tokens):
    return extend_block_hashes([], tokens, BS)


def admit(pool, request_id, tokens, max_new_tokens=None):
    candidate = Candidate(request_id, len(tokens), max_new_tokens or len(tokens),
                          hashes(tokens)[:(len(tokens) - 1) // BS])
    granted = pool.grant(AllocateSlots(0, [], [], [], [candidate]))
    return granted.admitted[0] if granted.admitted else None


def computed(pool, request_id, tokens, first_block=0):
    pool.grant(AllocateSlots(0, [], [], [], [], [ComputedBlocks(
        request_id, first_block, hashes(tokens)[first_block:])]))


def decode(pool, request_id, num_computed, step=1):
    """One step of ``request_id`` computing its token at ``num_computed``."""
    return pool.grant(AllocateSlots(step, [], [request_id], [num_computed + 1],
                                    num_computed_tokens=[num_computed]))


def finish(pool, *request_ids):
    pool.grant(AllocateSlots(0, list(request_ids), [], []))


def held(table):
    return [block for block in table if block != NULL_BLOCK]


def assert_counts_agree(pool):
    used = pool.num_used_blocks
    assert sum(used) == pool.num_total_blocks - pool.num_free_blocks, used


def test_a_sliding_group_holds_only_its_window_while_the_full_group_holds_everything():
    pool = BlockPool(128, BS, windows=(FULL, WINDOW))
    prompt = list(range(100, 110))
    admit(pool, "a", prompt)
    bound = -(-WINDOW // BS) + 1
    seen_sliding = set()
    for num_computed in range(len(prompt), len(prompt) + WINDOW + 200):
        granted = decode(pool, "a", num_computed)
        assert granted.preempted_ids == []
        full, sliding = pool.blocks_of("a")
        num_tokens = num_computed + 1
        assert len(full) == len(sliding) == -(-num_tokens // BS)
        assert NULL_BLOCK not in full and len(set(full)) == len(full)  # every block, its own
        assert len(held(sliding)) <= bound, (num_computed, sliding)
        # only positions a future query can read are gone: nothing at or past the window
        first_needed = (num_computed - WINDOW + 1) // BS
        assert all(b != NULL_BLOCK for b in sliding[max(0, first_needed):])
        assert all(b == NULL_BLOCK for b in sliding[:max(0, first_needed)])
        assert pool.num_used_blocks == [len(full), len(held(sliding))]
        assert_counts_agree(pool)
        seen_sliding.update(held(sliding))
    # what the window left went back to the pool and was used again (by the full group)
    assert len(seen_sliding) > 2 * bound
    assert len(seen_sliding | set(full)) <= len(full) + bound
    finish(pool, "a")
    assert pool.num_free_blocks == pool.num_total_blocks == 127
    assert pool.num_used_blocks == [0, 0]


def test_blocks_a_window_left_serve_other_requests():
    # too small for two full-attention requests of 40 tokens (10 blocks each)
    pool = BlockPool(1 + 8, BS, windows=(WINDOW,))
    admit(pool, "a", list(range(5)))
    released = set()
    for num_computed in range(5, 40):
        before = set(held(pool.blocks_of("a")[0]))
        assert decode(pool, "a", num_computed).preempted_ids == []
        released |= before - set(held(pool.blocks_of("a")[0]))
    b = admit(pool, "b", list(range(50, 70)))
    assert b is not None and set(b.block_ids[0]) & released
    assert set(held(pool.blocks_of("a")[0])).isdisjoint(b.block_ids[0])
    finish(pool, "a", "b")
    assert pool.num_free_blocks == pool.num_total_blocks == 8


@pytest.mark.parametrize("windows", [(FULL, WINDOW), (WINDOW,), (WINDOW, 2 * WINDOW)])
def test_the_placeholder_block_is_never_handed_out(windows):
    pool = BlockPool(13, BS, windows=windows)
    assert pool.num_total_blocks == 12 and pool.num_free_blocks == 12
    handed_out = []
    for i in range(12):
        admitted = admit(pool, f"r{i}", [i] * 3)  # one block in each group
        if admitted is None:
            break
        handed_out += [b for table in admitted.block_ids for b in table]
    assert NULL_BLOCK not in handed_out and sorted(handed_out) == list(range(1, 13))
    assert pool.num_free_blocks == 0 and admit(pool, "late", [1]) is None
    assert_counts_agree(pool)


def test_one_full_group_has_no_placeholder():
    pool = BlockPool(3, BS)
    assert pool.num_total_blocks == 3
    assert sorted(b for i in range(3) for b in admit(pool, f"r{i}", [i]).block_ids[0]) == \
        [0, 1, 2]


def _evicting_scenario(num_evicted: int):
    """a (26-token prompt, computed) holds its full blocks and, once its window moves on,
    lets its sliding blocks 0-3 go (cached). A filler then evicts the free blocks and
    ``num_evicted`` of a's released ones (the deepest first), then finishes. Returns the
    pool, a's first tables and b's admission: a's first 17 tokens (4 full blocks)."""
    pool = BlockPool(1 + 2 * 7 + 4, BS, windows=(FULL, WINDOW))
    prompt = list(range(200, 226))
    a = admit(pool, "a", prompt)
    computed(pool, "a", prompt)
    decode(pool, "a", len(prompt))  # a's window now starts at 19: sliding blocks 0-3 go
    assert len(held(pool.blocks_of("a")[1])) == 3 and pool.num_cached_blocks == 4
    # the free blocks: 4 uncached, then a's released sliding blocks, deepest first
    filler = admit(pool, "filler", list(range(900, 900 + 2 * (4 + num_evicted))))
    assert filler is not None and pool.num_cached_blocks == 4 - num_evicted
    finish(pool, "filler")
    return pool, a.block_ids, admit(pool, "b", prompt[:17])


def test_a_hit_needs_the_sliding_groups_window_before_its_end():
    pool, (a_full, a_sliding), b = _evicting_scenario(num_evicted=0)
    # the full group has a's first 4 blocks; the sliding group needs only blocks 2, 3
    # (positions 9-15, which a query at 16 reads), cached though a let them go
    assert b.num_cached_tokens == 16
    full, sliding = b.block_ids
    assert full[:4] == a_full[:4]
    assert sliding[:4] == [NULL_BLOCK, NULL_BLOCK] + a_sliding[2:4]

    pool, (a_full, a_sliding), b = _evicting_scenario(num_evicted=2)  # a's sliding 3, 2
    # the full group still has 4 blocks, but a sliding hit at 16 or 12 needs an evicted
    # block: the longest is 8, whose window (blocks 0, 1) is still cached
    assert b.num_cached_tokens == 8
    full, sliding = b.block_ids
    assert full[:2] == a_full[:2] and sliding[:2] == a_sliding[:2]
    assert a_full[2] not in full and NULL_BLOCK not in full
    finish(pool, "a", "b")
    assert pool.num_free_blocks == pool.num_total_blocks


def test_a_sliding_only_model_hits_with_only_the_last_window_cached():
    pool = BlockPool(1 + 7 + 7, BS, windows=(WINDOW,))
    prompt = list(range(300, 326))  # 6 full blocks and 2 tokens
    admit(pool, "a", prompt)
    computed(pool, "a", prompt)
    decode(pool, "a", len(prompt))  # blocks 0-3 go back to the pool, cached
    free = pool.num_free_blocks
    assert admit(pool, "filler", list(range(900, 900 + BS * free))) is not None
    assert pool.num_cached_blocks == 0  # a's released blocks 0-3 are evicted
    finish(pool, "filler")
    b = admit(pool, "b", prompt[:25])
    # blocks 4, 5 hold positions 16-23, which a query at 24 reads (17-24): a hit of 24
    assert b.num_cached_tokens == 24
    assert b.block_ids[0][:6] == [NULL_BLOCK] * 4 + pool.blocks_of("a")[0][4:6]
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (26 + 4 * free + 25, 24)


def test_computed_blocks_are_cached_in_every_group():
    pool = BlockPool(32, BS, windows=(FULL, WINDOW, FULL))
    prompt = list(range(13))
    admit(pool, "a", prompt)
    computed(pool, "a", prompt)
    finish(pool, "a")
    assert pool.num_cached_blocks == 3 * 3  # 3 full blocks in each of 3 groups
    b = admit(pool, "b", prompt)
    assert b.num_cached_tokens == 12
    assert [len(held(t)) for t in b.block_ids] == [4, 3, 4]  # sliding: 2 hit + 1 new


def test_preemption_and_free_return_every_block():
    pool = BlockPool(1 + 12, BS, windows=(FULL, WINDOW))
    for rid in "abc":
        admit(pool, rid, [ord(rid)] * 4)  # one block a group each: 6 of 12
    granted = pool.grant(AllocateSlots(1, [], ["a", "b", "c"], [21, 5, 5],
                                       num_computed_tokens=[4, 4, 4]))
    # a grows by 5 blocks in each group: c goes (2 blocks back), then b
    assert granted.preempted_ids == ["c", "b"]
    assert [[len(ids) for ids in groups] for groups in granted.new_block_ids] == [[5, 5]]
    assert pool.blocks_of("b") == pool.blocks_of("c") == []
    assert granted.num_used_blocks == [6, 6] and granted.num_free_blocks == 0
    for num_computed in range(21, 30):  # a decodes on: its window makes the room it needs
        assert decode(pool, "a", num_computed).preempted_ids == []
        assert_counts_agree(pool)
    finish(pool, "a")
    assert pool.num_free_blocks == pool.num_total_blocks == 12
    assert pool.num_used_blocks == [0, 0] and pool.num_requests_holding_blocks == 0


def test_without_computed_counts_a_sliding_group_lets_nothing_go():
    pool = BlockPool(64, BS, windows=(WINDOW,))
    admit(pool, "a", list(range(30)))
    pool.grant(AllocateSlots(1, [], ["a"], [31]))
    assert NULL_BLOCK not in pool.blocks_of("a")[0]


def test_bad_windows_are_refused():
    with pytest.raises(ValueError, match="sliding windows must be positive"):
        BlockPool(8, BS, windows=(None, 0))
    with pytest.raises(ValueError, match="at least 2"):
        BlockPool(1, BS, windows=(4,))


def _evict(pool, group, block):
    """Forget the cached free ``block`` of ``group``, as an allocation that evicted it would
    (LRU order cannot single out one block here, so the test reaches in)."""
    del pool._block_of[group][pool._hash_of.pop(block)]
    pool._num_cached_free -= 1


def test_sliding_groups_are_asked_again_until_they_agree_on_the_hit():
    pool = BlockPool(64, BS, windows=(WINDOW, 2 * WINDOW))  # need 2 and 4 blocks
    prompt = list(range(400, 425))  # 6 full blocks and 1
    admit(pool, "r", prompt)
    computed(pool, "r", prompt)
    short, long = pool.blocks_of("r")
    finish(pool, "r")
    _evict(pool, 1, long[5])  # the long window's hit at 24 is gone: 20 needs 1-4
    _evict(pool, 0, short[3])  # the short window then cannot end at 20 (3, 4) or 16
    b = admit(pool, "b", prompt[:25])
    # within 12 tokens: the short window needs blocks 1, 2, the long one the run 0-2 from
    # the start; asked once each, they would have said 24 and 20
    assert b.num_cached_tokens == 12
    assert b.block_ids[0][:3] == [NULL_BLOCK] + short[1:3] and b.block_ids[1][:3] == long[:3]


@pytest.mark.parametrize("windows", [(FULL, WINDOW), (WINDOW,), (5, FULL, 13), (1,)])
@pytest.mark.parametrize("block_size,max_model_len,budget", [(4, 64, 16), (1, 20, 3),
                                                             (4, 37, 64), (8, 64, 5)])
def test_a_pool_of_max_blocks_per_sequence_runs_any_sequence_alone(windows, block_size,
                                                                   max_model_len, budget):
    import random

    size = max_blocks_per_sequence(windows, max_model_len, block_size, budget)
    full_only = -(-max_model_len // block_size) * len(windows)
    assert size <= full_only + 1
    for seed in range(5):
        rng = random.Random(seed)
        pool = BlockPool(size, block_size, windows=windows)
        first = rng.randint(1, min(budget, max_model_len))
        grant = pool.grant(AllocateSlots(0, [], [], [], [Candidate("a", max_model_len, first)]))
        assert grant.admitted, "the first chunk did not fit"
        num_computed = first
        while num_computed < max_model_len:
            n = rng.randint(1, min(budget, max_model_len - num_computed))
            grant = pool.grant(AllocateSlots(1, [], ["a"], [num_computed + n],
                                             num_computed_tokens=[num_computed]))
            assert grant.preempted_ids == [], (num_computed, n)
            num_computed += n
        finish(pool, "a")
        assert pool.num_free_blocks == pool.num_total_blocks
