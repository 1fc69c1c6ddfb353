"""The KVAllocatorActor alone, with a TestProbe as its scheduler."""

from actorlm.actors.kv_allocator import KVAllocatorActor
from actorlm.core.block_hash import extend_block_hashes
from actorlm.core.block_pool import BlockPool
from actorlm.messages import (Admitted, AllocateSlots, Candidate, ComputedBlocks, GetStats,
                              KVStats, ResetPrefixCache, SlotsGranted)


def test_allocator_decides_each_step_in_one_reply(make_probe):
    scheduler = make_probe("scheduler")
    allocator = KVAllocatorActor.start(BlockPool(8, block_size=4), scheduler.ref)
    prompt = list(range(10))
    hashes = extend_block_hashes([], prompt, 4)
    try:
        allocator.tell(AllocateSlots(0, [], [], [], [Candidate("a", 10, 10, hashes),
                                                    Candidate("b", 9, 9)]))
        assert scheduler.expect_message(SlotsGranted) == SlotsGranted(
            0, [], [], [Admitted("a", [[0, 1, 2]], 0, 10), Admitted("b", [[3, 4, 5]], 0, 9)], 2,
            0, [6])
        # a grows by 5 blocks: b, the lowest priority, is preempted to make room; no admission
        allocator.tell(AllocateSlots(1, [], ["a", "b"], [30, 10], [Candidate("c", 2, 2)],
                                     [ComputedBlocks("a", 0, hashes)]))
        granted = scheduler.expect_message(SlotsGranted)
        assert (granted.new_block_ids, granted.preempted_ids, granted.admitted) == \
            ([[[3, 4, 5, 6, 7]]], ["b"], [])
        assert allocator.ask(GetStats()) == KVStats(0, 8, 1, 0, 19, 0, [8])
        # a finishes: its computed blocks stay cached, and a repeat of its prompt hits them
        allocator.tell(AllocateSlots(2, ["a"], [], [], [Candidate("a2", 10, 10, hashes)]))
        [admitted] = scheduler.expect_message(SlotsGranted).admitted
        assert (admitted.block_ids[0][:2], admitted.num_cached_tokens) == ([0, 1], 8)
        assert allocator.ask(GetStats()) == KVStats(5, 8, 1, 0, 29, 8, [3])
        assert allocator.ask(ResetPrefixCache()) is True
        allocator.tell(AllocateSlots(3, ["a2"], [], [], [Candidate("a3", 10, 10, hashes)]))
        assert scheduler.expect_message(SlotsGranted).admitted[0].num_cached_tokens == 0
        scheduler.expect_no_message(0)
    finally:
        allocator.stop()


def test_allocator_serves_kv_cache_groups_from_one_pool(make_probe):
    scheduler = make_probe("scheduler")
    allocator = KVAllocatorActor.start(BlockPool(1 + 12, block_size=4, windows=(None, 4)),
                                       scheduler.ref)
    try:
        allocator.tell(AllocateSlots(0, [], [], [], [Candidate("a", 8, 8)]))
        [admitted] = scheduler.expect_message(SlotsGranted).admitted
        assert admitted.block_ids == [[1, 2], [3, 4]]  # block 0: the placeholder
        # a computes position 12: its window (positions 9-12) no longer reads its sliding
        # blocks 3, 4, which go back to the pool first: the full group grows into them
        allocator.tell(AllocateSlots(1, [], ["a"], [13], num_computed_tokens=[12]))
        granted = scheduler.expect_message(SlotsGranted)
        assert granted.new_block_ids == [[[3, 4], [5, 6]]] and granted.num_used_blocks == [4, 2]
        assert allocator.ask(GetStats()) == KVStats(6, 12, 1, 0, 8, 0, [4, 2])
    finally:
        allocator.stop()
