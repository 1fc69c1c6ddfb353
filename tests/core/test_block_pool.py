import pytest

from actorlm.core.block_pool import BlockPool


def test_allocate_and_free_round_trip():
    pool = BlockPool(8)
    a = pool.allocate("a", 3)
    b = pool.allocate("b", 2)
    assert len(set(a) | set(b)) == 5 and pool.num_free_blocks == 3
    assert pool.allocate("a", 1)[0] not in a + b
    assert pool.blocks_of("a")[:3] == a and len(pool.blocks_of("a")) == 4
    assert pool.free("a") == 4 and pool.num_free_blocks == 6
    assert pool.free("a") == 0  # freeing twice releases nothing
    pool.free("b")
    assert pool.num_free_blocks == 8 and pool.num_requests_holding_blocks == 0


def test_refuses_more_than_free_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate("a", 3)
    with pytest.raises(ValueError, match="1 free"):
        pool.allocate("b", 2)
    assert pool.num_free_blocks == 1 and pool.blocks_of("b") == []


def test_recently_freed_blocks_are_reused_last():
    pool = BlockPool(4)
    first = pool.allocate("a", 2)
    pool.free("a")
    assert not set(pool.allocate("b", 2)) & set(first)
