"""The paged KV cache's bookkeeping and its prefix cache. Pure and thread-free; the
KVAllocatorActor owns one, and nothing else keeps a copy of any of this:

- every request's block tables, one per KV-cache group (``actorlm.kv_groups``);
- a reference count per block (a block is shared by every request whose prefix it holds);
- the free blocks, in eviction order: a block nobody holds stays free *and cached* — its
  content hash still maps to it — until a fresh block is needed and it is the least recently
  used; a hit takes it back out of the free order;
- each group's hash → block map of the prefix cache.

``grant`` turns one step's proposal (``AllocateSlots``) into a decision that cannot fail,
because it is made here with the real counts: the running requests grow in priority order,
the lowest in that order are preempted when blocks run short, and waiting candidates are
admitted while blocks last, each starting at the longest prefix every group finds cached.

KV-cache groups (vLLM's hybrid allocator: ``KVCacheCoordinator``, ``SlidingWindowManager``).
The pool is built with each group's window (None: full attention). A block id is one page
in each of the group's layers, and every group has as many layers, so one pool of ids serves
them all; a block is held by one group at a time. Every group's table of a request has the
same length (one entry per ``block_size`` tokens). A full group keeps every block of its
table. A sliding group of window W lets go of the blocks whose positions no future query
reads (all below ``num_computed_tokens - W + 1``): they go back to the pool (cached ones
stay cached) and their entries become the placeholder ``NULL_BLOCK``. With a sliding group,
block 0 is that placeholder: never handed out, counted neither free nor used.

A prefix-cache hit must suit every group: a full group needs the whole prefix cached, a
sliding group only the blocks holding the last W - 1 tokens before the hit's end (the
entries before are placeholders). The hit is the longest length that all of them serve: the
full groups' common prefix, then each sliding group's longest hit within it, shrinking until
they agree (vLLM's ``HybridKVCacheCoordinator``).
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import islice
from typing import Sequence

from actorlm.messages import Admitted, AllocateSlots, Candidate, SlotsGranted

NULL_BLOCK = 0  # with a sliding group: the entry of a block that fell out of the window


def num_usable_blocks(num_blocks: int, windows: Sequence[int | None]) -> int:
    """The blocks a pool of ``num_blocks`` hands out: all but the placeholder, which it
    keeps when a group has a sliding window."""
    return num_blocks - any(w is not None for w in windows)


def max_blocks_per_sequence(windows: Sequence[int | None], max_model_len: int,
                            block_size: int, max_num_batched_tokens: int) -> int:
    """The most blocks one sequence can hold at once in a pool serving these groups (the
    placeholder included): every block of its context in a full group; in a sliding group
    those of its window and of the largest chunk a step computes. A pool smaller than this
    would preempt that sequence for itself forever."""
    per_group = -(-max_model_len // block_size)
    chunk = min(max_num_batched_tokens, max_model_len)
    placeholder = any(w is not None for w in windows)
    return placeholder + sum(
        per_group if w is None else min(per_group, -(-(chunk + w - 1) // block_size) + 1)
        for w in windows)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 windows: Sequence[int | None] = (None,)):
        if num_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be positive, got {num_blocks}")
        windows = tuple(windows)
        if not windows:
            raise ValueError("a KV pool serves at least one KV-cache group")
        if any(w is not None and w <= 0 for w in windows):
            raise ValueError(f"sliding windows must be positive, got {list(windows)}")
        self.windows, self.num_groups = windows, len(windows)
        self._full = [g for g, w in enumerate(windows) if w is None]
        self._sliding = [g for g, w in enumerate(windows) if w is not None]
        first = 1 if self._sliding else 0  # block 0: the placeholder, never handed out
        if num_blocks <= first:
            raise ValueError(f"num_kv_blocks must be at least 2 with a sliding-window group "
                             f"(block 0 is the placeholder), got {num_blocks}")
        # a block id no table holds when there is no placeholder
        self._null = NULL_BLOCK if self._sliding else -1
        self.num_total_blocks = num_usable_blocks(num_blocks, windows)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # front: evicted first. Plain dict order is insertion order; OrderedDict adds O(1)
        # moves to the front, where blocks with nothing cached go.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(first, num_blocks))
        self._ref_counts = [0] * num_blocks
        self._group_of = [0] * num_blocks  # the group that holds the block (or cached it)
        self._num_used = [0] * self.num_groups  # blocks some request holds, per group
        self._tables: dict[str, list[list[int]]] = {}  # request -> a table per group
        self._hash_of: dict[int, int] = {}  # block -> content hash, for cached blocks
        # per group: content hash -> block (the (group, hash) key of vLLM's map)
        self._block_of: list[dict[int, int]] = [{} for _ in windows]
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

    @property
    def num_used_blocks(self) -> list[int]:
        """Blocks some request holds, per group (they add up to total less free)."""
        return list(self._num_used)

    def blocks_of(self, request_id: str) -> list[list[int]]:
        """The request's table in each group (``NULL_BLOCK`` where a sliding group let go)."""
        return [list(table) for table in self._tables.get(request_id, ())]

    # --- one step -----------------------------------------------------------------------------

    def grant(self, msg: AllocateSlots) -> SlotsGranted:
        for computed in msg.computed_blocks:
            self.cache_blocks(computed.request_id, computed.first_block, computed.block_hashes)
        for request_id in msg.free_request_ids:
            self.free(request_id)
        if msg.reset_prefix_cache:
            self.reset_prefix_cache()
        running = list(zip(msg.request_ids, msg.num_tokens))
        num_groups = self.num_groups
        if self._sliding:  # before anyone grows: what falls out of a window makes room
            for request_id, num_computed in zip(msg.request_ids, msg.num_computed_tokens):
                if (tables := self._tables.get(request_id)) is not None:
                    self._release_out_of_window(tables, num_computed)
        new_block_ids, preempted = [], []
        while len(new_block_ids) < len(running):
            request_id, num_tokens = running[len(new_block_ids)]
            tables = self._tables.get(request_id)
            if tables is None:
                tables = self._tables[request_id] = [[] for _ in range(num_groups)]
            needed = self._num_blocks_for(num_tokens) - len(tables[0])  # in each group
            while needed * num_groups > len(self._free) and len(running) > len(new_block_ids):
                victim, _ = running.pop()  # the lowest priority goes first, maybe itself
                preempted.append(victim)
                self.free(victim)
            if len(new_block_ids) < len(running):
                new_block_ids.append([self._allocate(table, g, needed)
                                      for g, table in enumerate(tables)] if needed > 0 else [])
        admitted = [] if preempted else self._admit(msg.candidates)
        return SlotsGranted(msg.step_id, new_block_ids, preempted, admitted,
                            self.num_free_blocks, self.num_cached_blocks, list(self._num_used))

    def _admit(self, candidates: list[Candidate]) -> list[Admitted]:
        """Admit candidates in order while their blocks fit (first come, first served: one
        that does not fit stops the rest)."""
        admitted, null, num_groups = [], self._null, self.num_groups
        for c in candidates:
            if self.enable_prefix_caching and c.block_hashes:
                tables, num_hit = self._lookup(c.block_hashes)
            else:
                tables, num_hit = [[] for _ in range(num_groups)], 0
            num_cached = num_hit * self.block_size
            num_new_tokens = min(c.max_new_tokens, c.num_tokens - num_cached)
            needed = self._num_blocks_for(num_cached + num_new_tokens) - num_hit  # each group
            taken_from_free = sum(1 for table in tables for block in table
                                  if block != null and self._ref_counts[block] == 0)
            if needed * num_groups + taken_from_free > len(self._free):
                break
            if self.enable_prefix_caching:
                self.prefix_cache_queries += c.num_tokens
                self.prefix_cache_hits += num_cached
            for table in tables:
                for block in table:
                    if block != null:
                        self._take(block)
            self._tables[c.request_id] = tables
            for g, table in enumerate(tables):
                self._allocate(table, g, needed)
            admitted.append(Admitted(c.request_id, [list(table) for table in tables],
                                     num_cached, num_new_tokens))
        return admitted

    # --- blocks -------------------------------------------------------------------------------

    def allocate(self, request_id: str, num_blocks: int, group: int = 0) -> list[int]:
        """Append ``num_blocks`` fresh blocks to the request's table in ``group``, evicting
        the least recently used cached blocks; returns their ids."""
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks: {len(self._free)} free")
        tables = self._tables.setdefault(request_id, [[] for _ in range(self.num_groups)])
        return self._allocate(tables[group], group, num_blocks)

    def _allocate(self, table: list[int], group: int, num_blocks: int) -> list[int]:
        new_ids = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            if block in self._hash_of:  # evicted
                self._num_cached_free -= 1
                del self._block_of[self._group_of[block]][self._hash_of.pop(block)]
            self._ref_counts[block] = 1
            self._group_of[block] = group
            new_ids.append(block)
        self._num_used[group] += num_blocks
        table.extend(new_ids)
        return new_ids

    def free(self, request_id: str) -> int:
        """Drop every reference the request holds; returns how many blocks it held. A block
        no one holds any more becomes free, and stays cached if it has a hash: the deepest
        block of the request's prefix is evicted first, blocks with nothing cached before
        any cached one."""
        tables = self._tables.pop(request_id, None)
        if tables is None:
            return 0
        num_held, null = 0, self._null
        for table in tables:
            for block in reversed(table):
                if block != null:
                    self._release(block)
                    num_held += 1
        return num_held

    def cache_blocks(self, request_id: str, first_block: int, block_hashes: list[int]) -> None:
        """Record the content hashes of blocks whose KV is now computed, in every group. A
        block already cached (a hit) and a hash some other block of the group holds already
        are left as they are."""
        if not self.enable_prefix_caching:
            return
        null = self._null
        for table, block_of in zip(self._tables.get(request_id, ()), self._block_of):
            for block, block_hash in zip(table[first_block:], block_hashes):
                if block != null and block not in self._hash_of and block_hash not in block_of:
                    self._hash_of[block], block_of[block_hash] = block_hash, block

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix; blocks in use stay with their requests."""
        self._hash_of.clear()
        for block_of in self._block_of:
            block_of.clear()
        self._num_cached_free = 0

    # --- sliding windows and hits -------------------------------------------------------------

    def _release_out_of_window(self, tables: list[list[int]], num_computed_tokens: int) -> None:
        """Each sliding group lets go of the blocks below its window: the step's first query
        is at ``num_computed_tokens`` and reads nothing before ``num_computed_tokens - W + 1``.
        Placeholders form a prefix of the table, so the walk stops at the first one."""
        null, block_size = self._null, self.block_size
        for g in self._sliding:
            table = tables[g]
            num_skipped = min((num_computed_tokens - self.windows[g] + 1) // block_size,
                              len(table))
            for i in range(num_skipped - 1, -1, -1):  # the deepest first: evicted first
                block = table[i]
                if block == null:
                    break
                table[i] = null
                self._release(block)

    def _lookup(self, block_hashes: list[int]) -> tuple[list[list[int]], int]:
        """Each group's blocks of the longest prefix hit every group can serve, and its
        length in blocks."""
        num_hit = len(block_hashes)
        full_hits = []
        for g in self._full:
            hit = self._prefix_hit(self._block_of[g], block_hashes, num_hit)
            full_hits.append(hit)
            num_hit = len(hit)
        tables: list[list[int]] = [[] for _ in range(self.num_groups)]
        shrunk = bool(self._sliding)
        while shrunk:  # a sliding hit is no prefix of a longer one: ask again until all agree
            shrunk = False
            for g in self._sliding:
                tables[g] = self._window_hit(g, block_hashes, num_hit)
                if len(tables[g]) < num_hit:
                    num_hit, shrunk = len(tables[g]), True
        for g, hit in zip(self._full, full_hits):
            del hit[num_hit:]
            tables[g] = hit
        return tables, num_hit

    @staticmethod
    def _prefix_hit(block_of: dict[int, int], block_hashes: list[int],
                    max_blocks: int) -> list[int]:
        """A full group's blocks of the longest cached prefix of these hashes."""
        hit = []
        for block_hash in islice(block_hashes, max_blocks):
            block = block_of.get(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def _window_hit(self, group: int, block_hashes: list[int], max_blocks: int) -> list[int]:
        """A sliding group's table for the longest hit within ``max_blocks`` blocks: a run of
        cached blocks holding the W - 1 positions before the hit's end, placeholders before
        it (or a shorter run from the first block, which has nothing before it)."""
        num_needed = -(-(self.windows[group] - 1) // self.block_size)
        if num_needed == 0:  # a window of 1: a query reads only itself
            return [self._null] * max_blocks
        block_of, run = self._block_of[group], []  # run: the deepest first
        for i in range(max_blocks - 1, -1, -1):
            block = block_of.get(block_hashes[i])
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) == num_needed:
                return [self._null] * i + run[::-1]
        return run[::-1]

    # --- internals ----------------------------------------------------------------------------

    def _take(self, block: int) -> None:
        if self._ref_counts[block] == 0:  # a cached free block comes back into use
            del self._free[block]
            self._num_cached_free -= 1
            self._num_used[self._group_of[block]] += 1
        self._ref_counts[block] += 1

    def _release(self, block: int) -> None:
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._num_used[self._group_of[block]] -= 1
            self._free[block] = None
            if block in self._hash_of:
                self._num_cached_free += 1
            else:
                self._free.move_to_end(block, last=False)

    def _num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
