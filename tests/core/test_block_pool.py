"""The allocator's pool alone: tables, reference counts, the prefix cache and its eviction."""

from actorlm.core.block_hash import extend_block_hashes, hash_block
from actorlm.core.block_pool import BlockPool
from actorlm.messages import AllocateSlots, Candidate, ComputedBlocks

BS = 4


def hashes(tokens):
    return extend_block_hashes([], tokens, BS)


def admit(pool, request_id, tokens, max_new_tokens=None, step=0):
    """Propose one waiting request; returns its Admitted (None if it did not fit)."""
    candidate = Candidate(request_id, len(tokens), max_new_tokens or len(tokens),
                          hashes(tokens)[:(len(tokens) - 1) // BS])
    granted = pool.grant(AllocateSlots(step, [], [], [], [candidate]))
    return granted.admitted[0] if granted.admitted else None


def compute_all(pool, request_id, tokens):
    """The request's step ran: its full blocks' KV is now in the cache."""
    pool.grant(AllocateSlots(0, [], [], [], [], [ComputedBlocks(request_id, 0, hashes(tokens))]))


def finish(pool, request_id):
    pool.grant(AllocateSlots(0, [request_id], [], []))


def test_block_hashes_chain_on_the_parent_and_are_stable():
    a, b = hashes([1, 2, 3, 4, 5, 6, 7, 8, 9]), hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and len(b) == 2  # full blocks only
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix
    assert a[0] == hash_block(None, [1, 2, 3, 4])  # no per-process salt
    assert hash_block(None, [1, 2, 3, 4], ("lora-1",)) != a[0]  # extra keys change the KV
    grown = list(a)
    assert extend_block_hashes(grown, list(range(1, 13)), BS)[:2] == a and len(grown) == 3


def test_a_repeated_prompt_hits_every_full_block_but_the_last_token():
    pool = BlockPool(16, BS)
    prompt = list(range(10, 22))  # 12 tokens: 3 full blocks
    first = admit(pool, "a", prompt)
    assert (first.num_cached_tokens, first.num_new_tokens, len(first.block_ids[0])) == (0, 12, 3)
    compute_all(pool, "a", prompt)
    finish(pool, "a")
    again = admit(pool, "b", prompt)
    # the last block holds the last token, which must be computed: 2 blocks hit, 4 tokens to go
    assert (again.num_cached_tokens, again.num_new_tokens) == (8, 4)
    [again_ids], [first_ids] = again.block_ids, first.block_ids  # one group
    assert again_ids[:2] == first_ids[:2] and again_ids[2] != first_ids[2]
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (24, 8)


def test_a_miss_a_partial_block_prompt_and_a_diverging_prompt():
    pool = BlockPool(16, BS)
    shared = [7, 7, 7, 7, 8, 8, 8, 8]
    admit(pool, "a", shared + [1, 2, 3])  # 11 tokens: 2 full blocks and a partial one
    compute_all(pool, "a", shared + [1, 2, 3])
    assert admit(pool, "miss", [5] * 11).num_cached_tokens == 0
    assert admit(pool, "fork", shared + [9, 9]).num_cached_tokens == 8
    # one token past the cached blocks is all a prompt of exactly those blocks computes
    exact = admit(pool, "exact", shared)
    assert (exact.num_cached_tokens, exact.num_new_tokens) == (4, 4)
    assert admit(pool, "other-prefix", [6, 6, 6, 6] + shared[4:] + [1]).num_cached_tokens == 0


def test_a_live_request_shares_its_blocks_and_they_are_never_evicted():
    pool = BlockPool(4, BS)
    prompt = list(range(9))  # 2 full blocks + 1
    a = admit(pool, "a", prompt)
    compute_all(pool, "a", prompt)
    b = admit(pool, "b", prompt)
    assert b.block_ids[0][:2] == a.block_ids[0][:2] and pool.num_free_blocks == 0
    # no room: the newcomer waits; nothing a live request holds is taken from it
    assert admit(pool, "c", [50, 51, 52]) is None
    assert pool.blocks_of("a") == a.block_ids and pool.blocks_of("b") == b.block_ids
    finish(pool, "a")  # b still holds the shared blocks: only a's own last block comes free
    assert pool.num_free_blocks == 1 and pool.num_cached_blocks == 0
    assert admit(pool, "c", [50, 51, 52]) is not None
    assert set(pool.blocks_of("b")[0]) & set(pool.blocks_of("c")[0]) == set()


def test_eviction_takes_the_least_recently_used_and_the_deepest_block_first():
    pool = BlockPool(6, BS)
    old, new = list(range(100, 109)), list(range(200, 209))  # 2 full blocks + 1 each
    for rid, tokens in (("old", old), ("new", new)):
        admit(pool, rid, tokens)
        compute_all(pool, rid, tokens)
        finish(pool, rid)
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 4
    admit(pool, "x", [1, 2, 3])  # one fresh block: the partial ones (nothing cached) go first
    assert pool.num_cached_blocks == 4
    admit(pool, "y", [1, 2, 3])
    admit(pool, "z", [1, 2, 3])  # evicts old's deepest block
    assert pool.num_cached_blocks == 3
    for rid in "xyz":
        finish(pool, rid)
    assert admit(pool, "old-again", old).num_cached_tokens == 4  # its first block survived
    assert admit(pool, "new-again", new).num_cached_tokens == 8  # untouched


def test_a_hit_refreshes_a_prefix_so_it_outlives_a_newer_one():
    pool = BlockPool(4, BS)
    a, b = [1] * 5, [2] * 5
    for rid, tokens in (("a", a), ("b", b)):
        admit(pool, rid, tokens)
        compute_all(pool, rid, tokens)
        finish(pool, rid)
    admit(pool, "a2", a)  # a's block is used again: now more recent than b's
    finish(pool, "a2")
    admit(pool, "fill", [3] * 9)  # 3 blocks: the 2 uncached ones and then b's
    finish(pool, "fill")
    assert admit(pool, "a3", a).num_cached_tokens == 4
    assert admit(pool, "b3", b).num_cached_tokens == 0


def test_preemption_takes_the_tail_and_admits_no_one():
    pool = BlockPool(4, BS)
    admit(pool, "first", [1] * 4)
    admit(pool, "second", [2] * 4)
    admit(pool, "third", [3] * 4)
    granted = pool.grant(AllocateSlots(1, [], ["first", "second", "third"], [9, 5, 5],
                                       [Candidate("late", 1, 1)]))
    # first needs 2 more blocks: third (the tail) goes, then second
    assert granted.preempted_ids == ["third", "second"] and granted.admitted == []
    assert [[len(ids) for ids in groups] for groups in granted.new_block_ids] == [[2]]
    assert pool.blocks_of("second") == [] and len(pool.blocks_of("first")[0]) == 3


def test_reset_forgets_every_prefix_but_keeps_blocks_in_use():
    pool = BlockPool(8, BS)
    prompt = list(range(9))
    admit(pool, "a", prompt)
    compute_all(pool, "a", prompt)
    pool.grant(AllocateSlots(0, [], [], [], reset_prefix_cache=True))
    assert len(pool.blocks_of("a")[0]) == 3
    assert admit(pool, "b", prompt).num_cached_tokens == 0
    finish(pool, "a")
    finish(pool, "b")
    assert pool.num_free_blocks == 8 and pool.num_cached_blocks == 0


def test_caching_off_never_hits():
    pool = BlockPool(8, BS, enable_prefix_caching=False)
    prompt = list(range(9))
    admit(pool, "a", prompt)
    compute_all(pool, "a", prompt)
    finish(pool, "a")
    assert admit(pool, "b", prompt).num_cached_tokens == 0
    assert pool.num_cached_blocks == 0 and pool.prefix_cache_queries == 0
