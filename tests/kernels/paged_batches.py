"""Paged batches shared by the attention kernels' tests, and the bound they are held to.

Every kernel is compared with ``paged_attention_ref`` (float64, rounded once) within
``tolerance.attention_error``: what the kernel's own rounding can move, from each request's
head size, context length, scores and values, and from whether the kernel rounds the
probabilities to the input dtype before P @ V. With a sliding window the same bound holds over
the positions the window leaves visible; with capped scores, ``capped_attention_error``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from actorlm.kernels.reference import paged_attention_ref, request_context
from tolerance import (_oracle_rounding, _subnormal_error, assert_within, attention_error,
                       rounding_error, sum_error, unit_roundoff)


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


def attention_bound(inputs, scale, expected, probs=None, window=None, softcap=None,
                    sinks=None):
    """[T, Hq, D]: ``attention_error`` of each request of the paged batch ``inputs`` (as
    ``paged_attention_ref`` takes them), its context gathered through its block table; the
    kernel keeps scores and sums in fp32 and rounds P to ``probs`` (None: keeps it in fp32).

    ``sinks`` [Hq] are bounded as one more position every query sees, of value zero and score
    sinks[h] (a feature appended to q, 1, and to the keys, sinks[h] / scale at the sink and 0
    elsewhere, gives it that score). The sink's score then carries a score's error (D + 4
    roundings of |sinks[h]|, more than a kernel's one product by log2(e)), and its probability
    a rounding to the dtype that no kernel makes: slack that Triton's interpreter needs, which
    truncates P to bf16 rather than rounding it (a bias of up to 2 u a probability, which the
    sinkless bound absorbs in its u |o| sum_j p_j, a term a sink holding most of the mass
    shrinks)."""
    query, k_cache, v_cache, block_tables, query_start_loc, seq_lens = inputs
    error = attention_error if softcap is None else \
        functools.partial(capped_attention_error, softcap=softcap)
    assert softcap is None or sinks is None  # (no family has both)
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
        if window is not None:
            visible &= positions[None, :] > q_pos[:, None] - window
        q = query[start:end]
        if sinks is not None:
            q, k, v, visible = _with_sink_position(q, k, v, visible, sinks, scale)
        bound[start:end] = error(q, k, v, scale, visible, expected[start:end], probs=probs,
                                 output=query.dtype)
    return bound


def _with_sink_position(q, k, v, visible, sinks, scale):
    """(q, k, v, visible) with the sinks as one more position of value zero (``attention_bound``)."""
    sink_key = F.pad((sinks.double() / scale)[None, :, None], (k.shape[2], 0))  # [1, Hq, D+1]
    keys = torch.cat((F.pad(k.double(), (0, 1)), sink_key))  # [S + 1, Hq, D + 1]
    values = F.pad(v.double(), (0, 0, 0, 0, 0, 1))  # [S + 1, Hq, D]
    return (F.pad(q.double(), (0, 1), value=1.0), keys, values,
            F.pad(visible, (0, 1), value=True))


def capped_attention_error(query, key, value, scale, visible, expected, softcap,
                           accumulate=torch.float32, probs=None, output=None):
    """``tolerance.attention_error`` of attention whose scores s are capped at
    c = softcap * tanh(s / softcap) before the softmax. The cap's slope is at most 1, so an
    error of s passes through it no larger (step 1's D + 3 roundings); the cap adds its own:
    s / softcap (u |s| <= u A_j through that slope), tanh (a libm tanhf, torch's, or Triton's
    1 - 2 / (e^2x + 1): under 8 ulps of 1) and the product by softcap (u |c| <= u softcap),
    so 9 u softcap + u A_j more per score. The rest is ``attention_error``'s, over the capped
    scores."""
    q, k, v = query.double(), key.double(), value.double()
    u = unit_roundoff(accumulate)
    raw = torch.einsum("lhd,shd->hls", q, k) * scale  # [H, L, S]
    abs_scores = torch.einsum("lhd,shd->hls", q.abs(), k.abs()) * abs(scale)
    scores = (softcap * torch.tanh(raw / softcap)).masked_fill(~visible, float("-inf"))
    p = scores.softmax(-1)  # [H, L, S]
    o = torch.einsum("hls,shd->hld", p, v)  # [H, L, D]
    num_visible = visible.sum(-1).double()[None, :, None]  # [1, L, 1]
    below_max = (scores.amax(-1, keepdim=True) - scores).nan_to_num(0.0, posinf=0.0)
    delta = sum_error(q.shape[-1] + 3, abs_scores, accumulate) + u * abs_scores + \
        9 * u * softcap + u * below_max + 4 * u
    weight = torch.where(visible, p * delta, 0.0)  # [H, L, S]
    v_hsd = v.transpose(0, 1)  # [H, S, D]
    bound = (weight[..., None] * (v_hsd[:, None] - o[:, :, None]).abs()).sum(2)
    if probs is not None and probs != accumulate:
        e = torch.where(visible, torch.clamp(unit_roundoff(probs) * p,
                                             min=_subnormal_error(probs)), 0.0)
        bound = bound + e @ v_hsd.abs() + e.sum(-1, keepdim=True) * o.abs()
    num_roundings = 2 * num_visible + 2
    bound = bound + sum_error(num_roundings, p @ v_hsd.abs(), accumulate)
    bound = bound + o.abs() * (sum_error(num_roundings, 1.0, accumulate) + 2 * u)
    bound = bound.transpose(0, 1) + _oracle_rounding(expected)  # [L, H, D]
    if output is not None and output != accumulate:
        bound = bound + rounding_error(o.transpose(0, 1), output)
    return bound


def assert_matches_reference(out, inputs, scale, probs=None, rows=None, window=None,
                             softcap=None, sinks=None):
    """``out`` within ``attention_bound`` of ``paged_attention_ref`` (on ``rows`` of it, or
    every row), in the query's dtype; ``window``, ``softcap`` and ``sinks`` as the reference
    takes them."""
    expected = paged_attention_ref(*inputs, scale, window=window, softcap=softcap, sinks=sinks)
    bound = attention_bound(inputs, scale, expected, probs, window, softcap, sinks)
    if rows is not None:
        out, expected, bound = out[rows], expected[rows], bound[rows]
    dtype = inputs[0].dtype
    assert out.dtype == expected.dtype == dtype and out.shape == expected.shape
    assert torch.isfinite(out.float()).all()
    assert_within(out, expected, bound, f"attention ({dtype_id(dtype)})")
