"""paged_attention (Triton, interpreted on the CPU) against paged_attention_ref.

Every batch mixes prefill chunks with and without cached context and decodes in one launch;
the batches and the bound are in ``paged_batches``. The kernel keeps scores, softmax and sums in
fp32 and rounds P to the input dtype for P @ V, so each test's bound says ``probs=dtype``.
"""

from __future__ import annotations

import pytest
import torch

from actorlm.kernels.reference import paged_attention_ref
from actorlm.kernels.triton.paged_attention import paged_attention
from paged_batches import (MIXED_BATCH, assert_matches_reference, attention_bound, dtype_id,
                           make_batch)


def _check(inputs, scale, **kwargs):
    out = paged_attention(*inputs, scale, **kwargs)
    # fp32 scores and sums, P rounded to the input dtype before P @ V
    assert_matches_reference(out, inputs, scale, probs=inputs[0].dtype)


@pytest.mark.parametrize(
    "dtype, head_dim, num_kv_heads, gqa, block_size",
    [
        (torch.float32, 64, 2, 1, 16),
        (torch.float32, 80, 1, 3, 32),
        (torch.float32, 96, 1, 8, 16),
        (torch.float32, 128, 2, 3, 32),
        (torch.float16, 64, 1, 8, 32),
        (torch.float16, 96, 2, 3, 16),
        (torch.float16, 128, 1, 1, 16),
        (torch.bfloat16, 80, 2, 8, 16),
        (torch.bfloat16, 128, 1, 3, 32),
        (torch.bfloat16, 64, 4, 1, 32),
    ],
    ids=dtype_id,
)
def test_mixed_batch_matches_reference(dtype, head_dim, num_kv_heads, gqa, block_size):
    num_q_heads = num_kv_heads * gqa
    inputs = make_batch(MIXED_BATCH, num_q_heads, num_kv_heads, head_dim, block_size, dtype, seed=head_dim + gqa)
    _check(inputs, head_dim**-0.5)


@pytest.mark.parametrize(
    "dtype, head_dim, gqa, block_size, num_kv_splits",
    [
        (torch.float32, 128, 8, 32, 3),
        (torch.bfloat16, 64, 3, 16, 4),
        (torch.float16, 80, 1, 16, 2),
    ],
    ids=dtype_id,
)
def test_split_kv_matches_reference(dtype, head_dim, gqa, block_size, num_kv_splits):
    # The split-KV path is exact for any query, so it is checked on the mixed batch too.
    inputs = make_batch(MIXED_BATCH, 2 * gqa, 2, head_dim, block_size, dtype, seed=7 * num_kv_splits)
    _check(inputs, head_dim**-0.5, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize(
    "dtype, gqa, num_kv_splits",
    [(torch.float32, 8, 1), (torch.bfloat16, 1, 4), (torch.float16, 3, 1)],
    ids=dtype_id,
)
def test_pure_decode_batch_matches_reference(dtype, gqa, num_kv_splits):
    lens = [(1, c) for c in (0, 15, 16, 47, 100)]
    inputs = make_batch(lens, 2 * gqa, 2, 96, 16, dtype, seed=gqa)
    _check(inputs, 96**-0.5, max_query_len=1, max_seq_len=101, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_ragged_batches_match_reference(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    num_seqs = int(torch.randint(2, 7, (1,), generator=gen))
    lens = []
    for _ in range(num_seqs):
        is_decode = bool(torch.rand(1, generator=gen) < 0.5)
        q_len = 1 if is_decode else int(torch.randint(2, 40, (1,), generator=gen))
        lens.append((q_len, int(torch.randint(0, 60, (1,), generator=gen))))
    gqa = (1, 3, 8)[seed]
    inputs = make_batch(lens, 2 * gqa, 2, 64, (16, 32, 16)[seed], torch.float32, seed=seed)
    _check(inputs, 0.11)  # any scale, not only 1/sqrt(D)


def test_strided_query_and_idle_request():
    # query as a view into a fused qkv projection; one request schedules no token this step.
    lens = [(9, 3), (0, 12), (1, 40)]
    inputs = make_batch(lens, 6, 2, 80, 16, torch.float32, seed=5)
    query = inputs[0]
    qkv = torch.randn(query.shape[0], 10, 80)
    qkv[:, :6] = query
    strided = qkv[:, :6]
    assert not strided.is_contiguous()
    out = paged_attention(strided, *inputs[1:], 80**-0.5)
    assert_matches_reference(out, inputs, 80**-0.5)  # fp32 throughout


def test_each_query_sees_only_its_causal_prefix():
    # Changing cached values after a query's position (or past seq_len) must not change it.
    inputs = make_batch([(6, 10)], 2, 1, 64, 16, torch.float32, seed=9)
    query, k_cache, v_cache, block_tables, qsl, seq_lens = inputs
    before = paged_attention(*inputs, 0.125)
    last_block = int(block_tables[0, 0])  # positions 0..15 live there; the first query is at 10
    v_cache[last_block, 11:] += 100.0
    after = paged_attention(query, k_cache, v_cache, block_tables, qsl, seq_lens, 0.125)
    assert torch.equal(after[0], before[0])  # position 10 sees kv 0..10 only
    assert not torch.allclose(after[1], before[1])  # position 11 sees the change


def _sinks(num_q_heads):
    """[Hq] fp32: sinks across the scores' range (|s| up to ~4 in these batches) and two far
    above it: 30 (its head's mass almost all on the sink, the max taken over it) and 200 (exp
    overflows even fp32's range: the head's output underflows to zero)."""
    sinks = torch.linspace(-2.0, 4.0, num_q_heads)
    sinks[-2:] = torch.tensor([30.0, 200.0])
    return sinks


@pytest.mark.parametrize(
    "dtype, head_dim, num_kv_heads, gqa, block_size, window, num_kv_splits",
    [
        (torch.float32, 64, 2, 3, 16, None, 1),
        (torch.bfloat16, 80, 1, 8, 16, 24, 1),
        (torch.float16, 64, 2, 2, 32, None, 3),  # the merge of the splits adds the sink
        (torch.float32, 96, 1, 4, 16, 20, 2),
    ],
    ids=dtype_id,
)
def test_sinks_join_each_heads_denominator(dtype, head_dim, num_kv_heads, gqa, block_size, window,
                                           num_kv_splits):
    num_q_heads = num_kv_heads * gqa
    inputs = make_batch(MIXED_BATCH, num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                        seed=head_dim + gqa)
    scale, sinks = head_dim**-0.5, _sinks(num_q_heads)
    out = paged_attention(*inputs, scale, num_kv_splits=num_kv_splits, window=window, sinks=sinks)
    assert_matches_reference(out, inputs, scale, probs=dtype, window=window, sinks=sinks)
    expected = paged_attention_ref(*inputs, scale, window=window, sinks=sinks)
    bound = attention_bound(inputs, scale, expected, dtype, window, sinks=sinks)
    # each head's sink moves its output past the bound: a kernel without it would fail
    without = paged_attention_ref(*inputs, scale, window=window)
    moved = ((without.double() - expected.double()).abs() > bound).any(dim=2).any(dim=0)  # [Hq]
    assert moved.all(), moved


@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_sinks_of_minus_infinity_change_no_bit(num_kv_splits):
    # exp(-inf) = 0 joins the sum and the max stays the scores': the sink path adds nothing
    inputs = make_batch([(5, 32), (1, 70)], 6, 2, 64, 16, torch.bfloat16, seed=3)
    sinks = torch.full((6,), float("-inf"))
    without = paged_attention(*inputs, 0.125, num_kv_splits=num_kv_splits)
    assert torch.equal(paged_attention(*inputs, 0.125, num_kv_splits=num_kv_splits, sinks=sinks),
                       without)
