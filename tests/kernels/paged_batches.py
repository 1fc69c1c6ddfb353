"""Paged batches shared by the attention kernels' tests, and the bound they are held to.

Every kernel is compared with ``paged_attention_ref`` (float64, rounded once) within
``tolerance.attention_error``: what the kernel's own rounding can move, from each request's
head size, context length, scores and values, and from whether the kernel rounds the
probabilities to the input dtype before P @ V.
"""

from __future__ import annotations

import torch

from actorlm.kernels.reference import paged_attention_ref, request_context
from tolerance import assert_within, attention_error


def dtype_id(value):
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


# (query tokens this step, tokens already cached) per request:
MIXED_BATCH = [
    (37, 0),  # prefill from scratch, spans several KV blocks
    (1, 70),  # decode with a long context
    (16, 21),  # prefill chunk after cached context, not block aligned
    (1, 0),  # decode of a one-token sequence
    (1, 31),  # decode whose context ends on a block boundary
    (5, 32),  # short chunk starting on a block boundary
]


def make_batch(lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """Random paged inputs: shuffled physical blocks, garbage beyond each context."""
    gen = torch.Generator().manual_seed(seed)
    q_lens = [q for q, _ in lens]
    seq_lens = [q + c for q, c in lens]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_seq) + 1  # one padding column, filled with 0
    num_blocks = sum(blocks_per_seq) + 3
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(lens), max_blocks, dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = torch.tensor([physical.pop() for _ in range(n)], dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = (0.5 * torch.randn(num_blocks, block_size, num_kv_heads, head_dim,
                                 generator=gen)).to(dtype)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return query, k_cache, v_cache, block_tables, query_start_loc, torch.tensor(seq_lens, dtype=torch.int32)


def attention_bound(inputs, scale, expected, probs=None):
    """[T, Hq, D]: ``attention_error`` of each request of the paged batch ``inputs`` (as
    ``paged_attention_ref`` takes them), its context gathered through its block table; the
    kernel keeps scores and sums in fp32 and rounds P to ``probs`` (None: keeps it in fp32)."""
    query, k_cache, v_cache, block_tables, query_start_loc, seq_lens = inputs
    group = query.shape[1] // k_cache.shape[2]
    bound = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[b], starts[b + 1]
        if end == start:
            continue
        positions = torch.arange(seq_len, device=query.device)
        k, v = request_context(k_cache, v_cache, block_tables[b], seq_len, group)  # [S, Hq, D]
        q_pos = positions[seq_len - (end - start):]  # [L]
        visible = positions[None, :] <= q_pos[:, None]  # [L, S]
        bound[start:end] = attention_error(query[start:end], k, v, scale, visible,
                                           expected[start:end], probs=probs,
                                           output=query.dtype)
    return bound


def assert_matches_reference(out, inputs, scale, probs=None, rows=None):
    """``out`` within ``attention_bound`` of ``paged_attention_ref`` (on ``rows`` of it, or
    every row), in the query's dtype."""
    expected = paged_attention_ref(*inputs, scale)
    bound = attention_bound(inputs, scale, expected, probs)
    if rows is not None:
        out, expected, bound = out[rows], expected[rows], bound[rows]
    dtype = inputs[0].dtype
    assert out.dtype == expected.dtype == dtype and out.shape == expected.shape
    assert torch.isfinite(out.float()).all()
    assert_within(out, expected, bound, f"attention ({dtype_id(dtype)})")
