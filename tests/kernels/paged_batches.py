"""Paged batches shared by the attention kernels' tests, and the tolerances they are held to.

Tolerances (stated once, used everywhere):
- fp32: max |diff| <= 1e-4.
- fp16: |diff| <= 1e-2 and cosine similarity >= 0.9999.
- bf16: |diff| <= 1e-2 and cosine similarity >= 0.9999. One bf16 ulp is 2**-7 * |x|, so the
  values are drawn at a scale that keeps outputs below 2, where one ulp is below 1e-2.
"""

from __future__ import annotations

import torch

FP32_MAX_ABS = 1e-4
HALF_ATOL = 1e-2
MIN_COSINE = 0.9999


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
    # values of unit scale: attention outputs then stay below 2 in magnitude, where one bf16
    # ulp (2**-7 * |x|) is below the 1e-2 tolerance
    v_cache = (0.5 * torch.randn(num_blocks, block_size, num_kv_heads, head_dim,
                                 generator=gen)).to(dtype)
    query = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return query, k_cache, v_cache, block_tables, query_start_loc, torch.tensor(seq_lens, dtype=torch.int32)


def assert_close(out, ref, dtype):
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    diff = (out.float() - ref.float()).abs()
    assert torch.isfinite(out.float()).all()
    if dtype == torch.float32:
        assert diff.max().item() <= FP32_MAX_ABS, diff.max().item()
        return
    assert diff.max().item() <= HALF_ATOL, f"max |diff| {diff.max().item()}"
    cosine = torch.nn.functional.cosine_similarity(out.float().flatten(), ref.float().flatten(), dim=0)
    assert cosine.item() >= MIN_COSINE, cosine.item()
