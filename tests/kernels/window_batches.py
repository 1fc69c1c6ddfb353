"""Paged batches under a sliding window, as the allocator leaves them: the blocks a window no
longer reaches are freed, their memory reused, their table entries left naming anything.

``with_freed_blocks`` turns a batch of ``paged_batches.make_batch`` into that state with every
unread byte poisoned (NaN), so a kernel that reads one block it should not, even to mask it,
returns NaN; the same batch unpoisoned is the reference's input.
"""

from __future__ import annotations

import torch

WINDOW = 21  # not a multiple of the block sizes tested (16, 32)

# (query tokens this step, tokens already cached) per request, against WINDOW:
WINDOW_BATCH = [
    (37, 0),  # a prefill from scratch, longer than the window
    (1, 70),  # a decode far past it
    (16, 21),  # a chunk after cached context: its first query's window starts at position 1
    (1, 0),  # a one-token sequence
    (1, 12),  # a decode shorter than the window
    (1, 20),  # a decode whose context is the window exactly
    (5, 32),  # a short chunk starting on a block boundary
    (3, 100),  # a chunk far past the window
]


def first_seen(q_len: int, seq_len: int, window: int) -> int:
    """The first position any of a request's queries sees: its earliest query's window."""
    return max(0, seq_len - q_len - window + 1)


def with_freed_blocks(inputs, window):
    """(poisoned, clean, num_freed): ``inputs`` with every block that holds only positions
    outside its request's window freed: their table entries name, in turn, block 0 (the
    placeholder) or a block another request reads; every block no request reads (block 0, the
    freed ones, the spare ones) is NaN in ``poisoned``. ``clean``: the same tables before
    freeing, over unpoisoned caches (block 0 moved to a spare block first if a context held
    it, so that it is free). ``num_freed``: how many table entries were freed."""
    query, k_cache, v_cache, block_tables, query_start_loc, seq_lens = inputs
    block_size, num_blocks = k_cache.shape[1], k_cache.shape[0]
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    tables, k_clean, v_clean = block_tables.clone(), k_cache.clone(), v_cache.clone()
    spans = [(first_seen(q, s, window) // block_size, -(-s // block_size))
             for q, s in zip(q_lens, seq_lens.tolist())]  # (first block read, blocks)
    used = {int(i) for b, (_, n) in enumerate(spans) for i in tables[b, :n]}
    if 0 in used:  # move it: block 0 is the placeholder
        spare = next(i for i in range(1, num_blocks) if i not in used)
        k_clean[spare], v_clean[spare] = k_clean[0], v_clean[0]
        for b, (_, n) in enumerate(spans):
            row = tables[b, :n]
            row[row == 0] = spare
    live = [tables[b, first:n].tolist() for b, (first, n) in enumerate(spans)]
    poisoned_tables, num_freed = tables.clone(), 0
    for b, (first, _) in enumerate(spans):
        others = [i for c, blocks in enumerate(live) if c != b for i in blocks]
        for j in range(first):
            reused = others[j % len(others)] if others and j % 2 else 0
            poisoned_tables[b, j] = reused
            num_freed += 1
    read = {i for blocks in live for i in blocks}
    unread = torch.tensor([i for i in range(num_blocks) if i not in read], dtype=torch.long)
    k_poisoned, v_poisoned = k_clean.clone(), v_clean.clone()
    k_poisoned[unread] = float("nan")
    v_poisoned[unread] = float("nan")
    clean = (query, k_clean, v_clean, tables, query_start_loc, seq_lens)
    poisoned = (query, k_poisoned, v_poisoned, poisoned_tables, query_start_loc, seq_lens)
    return poisoned, clean, num_freed
