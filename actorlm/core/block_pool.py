"""The paged KV cache's bookkeeping and its prefix cache. Pure and thread-free; the
KVAllocatorActor owns one, and nothing else keeps a copy of any of this:

- every request's block table;
- a reference count per block (a block is shared by every request whose prefix it holds);
- the free blocks, in eviction order: a block nobody holds stays free *and cached* — its
  content hash still maps to it — until a fresh block is needed and it is the least recently
  used; a hit takes it back out of the free order;
- the hash → block map of the prefix cache.

``grant`` turns one step's proposal (``AllocateSlots``) into a decision that cannot fail,
because it is made here with the real counts: the running requests grow in priority order,
the lowest in that order are preempted when blocks run short, and waiting candidates are
admitted while blocks last, each starting at the longest prefix of full blocks found cached.
"""

from __future__ import annotations

from collections import OrderedDict

from actorlm.messages import Admitted, AllocateSlots, Candidate, SlotsGranted


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {num_blocks}")
        self.num_total_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        # front: evicted first. Plain dict order is insertion order; OrderedDict adds O(1)
        # moves to the front, where blocks with nothing cached go.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[str, list[int]] = {}
        self._hash_of: dict[int, int] = {}  # block -> content hash, for cached blocks
        self._block_of: dict[int, int] = {}  # content hash -> block
        self._num_cached_free = 0  # free blocks in _hash_of
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # --- counts -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody holds, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks still holding a cached prefix."""
        return self._num_cached_free

    @property
    def num_requests_holding_blocks(self) -> int:
        return len(self._tables)

    def blocks_of(self, request_id: str) -> list[int]:
        return list(self._tables.get(request_id, ()))

    # --- one step -----------------------------------------------------------------------------

    def grant(self, msg: AllocateSlots) -> SlotsGranted:
        for computed in msg.computed_blocks:
            self.cache_blocks(computed.request_id, computed.first_block, computed.block_hashes)
        for request_id in msg.free_request_ids:
            self.free(request_id)
        if msg.reset_prefix_cache:
            self.reset_prefix_cache()
        running = list(zip(msg.request_ids, msg.num_tokens))
        new_block_ids, preempted = [], []
        while len(new_block_ids) < len(running):
            request_id, num_tokens = running[len(new_block_ids)]
            needed = self._num_blocks_for(num_tokens) - len(self._tables.get(request_id, ()))
            while needed > len(self._free) and len(running) > len(new_block_ids):
                victim, _ = running.pop()  # the lowest priority goes first, maybe itself
                preempted.append(victim)
                self.free(victim)
            if len(new_block_ids) < len(running):
                new_block_ids.append(self.allocate(request_id, needed))
        admitted = [] if preempted else self._admit(msg.candidates)
        return SlotsGranted(msg.step_id, new_block_ids, preempted, admitted,
                            self.num_free_blocks, self.num_cached_blocks)

    def _admit(self, candidates: list[Candidate]) -> list[Admitted]:
        """Admit candidates in order while their blocks fit (first come, first served: one
        that does not fit stops the rest)."""
        admitted = []
        for c in candidates:
            hit = self._lookup(c.block_hashes) if self.enable_prefix_caching else []
            num_cached = len(hit) * self.block_size
            num_new_tokens = min(c.max_new_tokens, c.num_tokens - num_cached)
            needed = self._num_blocks_for(num_cached + num_new_tokens) - len(hit)
            taken_from_free = sum(1 for block in hit if self._ref_counts[block] == 0)
            if needed + taken_from_free > len(self._free):
                break
            if self.enable_prefix_caching:
                self.prefix_cache_queries += c.num_tokens
                self.prefix_cache_hits += num_cached
            for block in hit:
                self._take(block)
            self._tables[c.request_id] = list(hit)
            self.allocate(c.request_id, needed)
            admitted.append(Admitted(c.request_id, list(self._tables[c.request_id]),
                                     num_cached, num_new_tokens))
        return admitted

    # --- blocks -------------------------------------------------------------------------------

    def allocate(self, request_id: str, num_blocks: int) -> list[int]:
        """Append ``num_blocks`` fresh blocks to the request's table, evicting the least
        recently used cached blocks; returns their ids."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks: {len(self._free)} free")
        new_ids = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            if block in self._hash_of:  # evicted
                self._num_cached_free -= 1
                del self._block_of[self._hash_of.pop(block)]
            self._ref_counts[block] = 1
            new_ids.append(block)
        self._tables.setdefault(request_id, []).extend(new_ids)
        return new_ids

    def free(self, request_id: str) -> int:
        """Drop every reference the request holds; returns how many blocks it held. A block
        no one holds any more becomes free, and stays cached if it has a hash: the deepest
        block of the request's prefix is evicted first, blocks with nothing cached before
        any cached one."""
        table = self._tables.pop(request_id, [])
        for block in reversed(table):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if block in self._hash_of:
                    self._num_cached_free += 1
                else:
                    self._free.move_to_end(block, last=False)
        return len(table)

    def cache_blocks(self, request_id: str, first_block: int, block_hashes: list[int]) -> None:
        """Record the content hashes of blocks whose KV is now computed. A block already
        cached (a hit) and a hash some other block holds already are left as they are."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request_id, ())
        for block, block_hash in zip(table[first_block:], block_hashes):
            if block not in self._hash_of and block_hash not in self._block_of:
                self._hash_of[block], self._block_of[block_hash] = block_hash, block

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; blocks in use stay with their requests."""
        self._hash_of.clear()
        self._block_of.clear()
        self._num_cached_free = 0

    def _lookup(self, block_hashes: list[int]) -> list[int]:
        """The blocks of the longest cached prefix of these hashes."""
        hit = []
        for block_hash in block_hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def _take(self, block: int) -> None:
        if self._ref_counts[block] == 0:  # a cached free block comes back into use
            del self._free[block]
            self._num_cached_free -= 1
        self._ref_counts[block] += 1

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
