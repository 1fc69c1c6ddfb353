"""The KVAllocatorActor alone, with a TestProbe as its scheduler."""

from actorlm.actors.kv_allocator import KVAllocatorActor
from actorlm.messages import AllocateSlots, GetStats, KVStats, SlotsGranted, SlotsRefused


def test_allocator_grants_refuses_and_frees_one_step_at_a_time(make_probe):
    scheduler = make_probe("scheduler")
    allocator = KVAllocatorActor.start(8, scheduler.ref)
    try:
        allocator.tell(AllocateSlots(0, [], ["a", "b"], [2, 3]))
        assert scheduler.expect_message(SlotsGranted) == SlotsGranted(0, ["a", "b"],
                                                                       [[0, 1], [2, 3, 4]], 3, 8)
        # a step that asks for more than is free is refused whole: nothing changes
        allocator.tell(AllocateSlots(1, [], ["a", "c"], [1, 3]))
        refused = scheduler.expect_message(SlotsRefused)
        assert (refused.step_id, refused.num_free_blocks) == (1, 3)
        assert allocator.ask(GetStats()) == KVStats(3, 8, 2)
        # frees come first, so the same step can reuse them
        allocator.tell(AllocateSlots(2, ["b"], ["a"], [4]))
        granted = scheduler.expect_message(SlotsGranted)
        assert granted.new_block_ids == [[5, 6, 7, 2]] and granted.num_free_blocks == 2
        allocator.tell(AllocateSlots(3, ["a"], [], []))
        assert scheduler.expect_message(SlotsGranted).num_free_blocks == 8
        assert allocator.ask(GetStats()) == KVStats(8, 8, 0)  # a barrier as well
        scheduler.expect_no_message(0)
    finally:
        allocator.stop()
