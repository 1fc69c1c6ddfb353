"""The paged KV cache's bookkeeping: which physical blocks are free and who holds the rest.

Pure and thread-free; the KVAllocatorActor owns one. Blocks are handed out from a FIFO free
queue so that recently freed blocks are reused last — the order prefix caching will want when
freed blocks stay cached until evicted. Every allocated block carries a reference count so that
shared blocks (prefixes, n > 1) can be added without changing the interface.
"""

from __future__ import annotations

from collections import deque

from actorlm.messages import AllocateSlots, SlotsGranted, SlotsRefused


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {num_blocks}")
        self.num_total_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._blocks_by_request: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_requests_holding_blocks(self) -> int:
        return len(self._blocks_by_request)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, request_id: str, num_blocks: int) -> list[int]:
        """Append ``num_blocks`` fresh blocks to the request's table; returns their ids."""
        if not self.can_allocate(num_blocks):
            raise ValueError(f"cannot allocate {num_blocks} blocks: {len(self._free)} free")
        new_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in new_ids:
            self._ref_counts[block_id] += 1
        self._blocks_by_request.setdefault(request_id, []).extend(new_ids)
        return new_ids

    def share(self, request_id: str, block_ids: list[int]) -> None:
        """Append blocks another request holds to this request's table (one more reference)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                raise ValueError(f"cannot share block {block_id}: it is free")
        for block_id in block_ids:
            self._ref_counts[block_id] += 1
        self._blocks_by_request.setdefault(request_id, []).extend(block_ids)

    def free(self, request_id: str) -> int:
        """Drop every reference the request holds; returns how many blocks it held."""
        block_ids = self._blocks_by_request.pop(request_id, [])
        for block_id in block_ids:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] == 0:
                self._free.append(block_id)
        return len(block_ids)

    def blocks_of(self, request_id: str) -> list[int]:
        return list(self._blocks_by_request.get(request_id, ()))

    def grant(self, msg: AllocateSlots) -> SlotsGranted | SlotsRefused:
        """Apply one step's block traffic: share, free, then grant the whole step or nothing."""
        for request_id, block_ids in zip(msg.share_request_ids, msg.shared_block_ids):
            self.share(request_id, block_ids)
        for request_id in msg.free_request_ids:
            self.free(request_id)
        needed = sum(msg.num_new_blocks)
        if not self.can_allocate(needed):
            return SlotsRefused(msg.step_id, f"{needed} blocks asked, {self.num_free_blocks} free",
                                self.num_free_blocks)
        new_ids = [self.allocate(rid, n) for rid, n in zip(msg.request_ids, msg.num_new_blocks)]
        return SlotsGranted(msg.step_id, msg.request_ids, new_ids, self.num_free_blocks,
                            self.num_total_blocks)
