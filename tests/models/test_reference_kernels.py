"""The torch twins against naive per-request computations (they are the oracle for Triton)."""

from __future__ import annotations

import pytest
import torch

from actorlm.kernels.cpu.sampler import sample as sample_ref
from actorlm.kernels.reference import paged_attention_ref, write_kv_ref

# (q_len, seq_len) per request: decodes, fresh prefills, and prefill chunks over cached context.
BATCHES = {
    "decodes": [(1, 1), (1, 7), (1, 33), (1, 16), (1, 50)],
    "prefills": [(5, 5), (1, 1), (17, 17), (3, 3)],
    "mixed": [(1, 9), (6, 20), (1, 1), (13, 13), (4, 37), (1, 64), (2, 2), (9, 15)],
}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _naive_attention(q, k, v, scale):
    """q: [L, Hq, D], k, v: [S, Hkv, D] (the last L of S positions query) -> [L, Hq, D] fp32."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q.float(), k) * scale  # [Hq, L, S]
    q_pos = torch.arange(seq_len - q_len, seq_len)
    causal = torch.arange(seq_len)[None, :] <= q_pos[:, None]  # [L, S]
    scores = scores.masked_fill(~causal, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


def _paged_case(batch, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Random per-request K/V written into a shuffled paged cache, plus the flattened inputs."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for _, s in batch)
    num_blocks = 1 + sum(-(-s // block_size) for _, s in batch) + 3  # block 0 stays unused padding
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(len(batch), max_blocks + 2, dtype=torch.int32)  # wider than needed
    queries, keys, values, starts = [], [], [], [0]
    for b, (q_len, seq_len) in enumerate(batch):
        blocks = [free.pop() for _ in range(-(-seq_len // block_size))]
        block_tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(seq_len)
        slots = torch.tensor(blocks)[pos // block_size] * block_size + pos % block_size
        write_kv_ref(k, v, k_cache, v_cache, slots)
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype))
        keys.append(k)
        values.append(v)
        starts.append(starts[-1] + q_len)
    return dict(
        query=torch.cat(queries),
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([s for _, s in batch], dtype=torch.int32),
        per_request=list(zip(queries, keys, values)),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [48, 64])
@pytest.mark.parametrize("batch_name", sorted(BATCHES))
def test_paged_attention_matches_naive(batch_name, head_dim, num_heads, num_kv_heads, block_size, dtype):
    batch = BATCHES[batch_name]
    case = _paged_case(batch, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    args = [case[k] for k in ("query", "k_cache", "v_cache", "block_tables", "query_start_loc", "seq_lens")]
    out = paged_attention_ref(*args, scale)
    assert out.shape == case["query"].shape and out.dtype == dtype
    assert torch.isfinite(out.float()).all()
    expected = torch.cat([_naive_attention(q, k, v, scale) for q, k, v in case["per_request"]])
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=0)
    cosine = torch.nn.functional.cosine_similarity(out.float().flatten(), expected.flatten(), dim=0)
    assert cosine > 0.9999
    # Host-side maxima given by the caller must not change the result.
    hinted = paged_attention_ref(
        *args, scale, max_query_len=max(q for q, _ in batch), max_seq_len=max(s for _, s in batch)
    )
    torch.testing.assert_close(hinted, out, atol=0, rtol=0)


def test_paged_attention_is_independent_of_batch_neighbours():
    # The same request alone and inside a ragged batch: padded query rows must not leak.
    batch = BATCHES["mixed"]
    case = _paged_case(batch, 4, 2, 32, 4, torch.float32)
    args = [case[k] for k in ("query", "k_cache", "v_cache", "block_tables", "query_start_loc", "seq_lens")]
    out = paged_attention_ref(*args, 0.2)
    b = 3  # a fresh 13-token prefill between decodes and a chunk over cached context
    start, end = case["query_start_loc"][b : b + 2].tolist()
    alone = paged_attention_ref(
        case["query"][start:end], case["k_cache"], case["v_cache"], case["block_tables"][b : b + 1],
        torch.tensor([0, end - start], dtype=torch.int32), case["seq_lens"][b : b + 1], 0.2,
    )  # fmt: skip
    torch.testing.assert_close(out[start:end], alone, atol=1e-6, rtol=0)


def test_write_kv_round_trip_and_skip():
    k_cache = torch.zeros(5, 4, 2, 8)
    v_cache = torch.zeros_like(k_cache)
    key, value = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    slots = torch.tensor([13, 2, -1, 19, 4, -1])
    write_kv_ref(key, value, k_cache, v_cache, slots)
    k_flat, v_flat = k_cache.view(-1, 2, 8), v_cache.view(-1, 2, 8)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_flat[slot], key[i]) and torch.equal(v_flat[slot], value[i])
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(20) if s not in written]
    assert not k_flat[untouched].any() and not v_flat[untouched].any()


def _sampling_args(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, positions=None):
    b = logits.shape[0]
    full = lambda value, dtype: torch.full((b,), value, dtype=dtype)  # noqa: E731
    return dict(
        logits=logits,
        temperature=full(temperature, torch.float32),
        top_k=full(top_k, torch.int32),
        top_p=full(top_p, torch.float32),
        min_p=full(min_p, torch.float32),
        seeds=torch.arange(b, dtype=torch.int64) if seeds is None else seeds,
        positions=torch.zeros(b, dtype=torch.int64) if positions is None else positions,
    )


def test_greedy_is_argmax_with_lowest_index_on_ties():
    logits = torch.randn(6, 50)
    logits[0, [7, 30]] = 100.0  # a tie
    tokens = sample_ref(**_sampling_args(logits, temperature=0.0))
    assert tokens.dtype == torch.int64
    assert tokens.tolist() == logits.argmax(-1).tolist()
    assert tokens[0] == 7


def test_truncation_never_returns_a_masked_token():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(512, 64, generator=gen) * 2
    probs = logits.softmax(-1)
    seeds = torch.randint(0, 2**62, (512,), generator=gen)
    # top-k
    tokens = sample_ref(**_sampling_args(logits, top_k=5, seeds=seeds))
    top5 = logits.topk(5, dim=-1).indices
    assert (top5 == tokens[:, None]).any(-1).all()
    # top-p: the smallest head whose mass reaches 0.6
    tokens = sample_ref(**_sampling_args(logits, top_p=0.6, seeds=seeds))
    sorted_p, order = probs.sort(-1, descending=True)
    before = sorted_p.cumsum(-1) - sorted_p
    rank = (order == tokens[:, None]).float().argmax(-1)
    assert (before.gather(1, rank[:, None]) < 0.6 + 1e-6).all()
    # min-p
    tokens = sample_ref(**_sampling_args(logits, min_p=0.3, seeds=seeds))
    chosen = probs.gather(1, tokens[:, None]).flatten()
    assert (chosen >= 0.3 * probs.max(-1).values - 1e-7).all()
    # all three at once, per-row values, and a row where only one token can survive
    args = _sampling_args(logits, seeds=seeds)
    args["top_k"] = torch.randint(0, 10, (512,), generator=gen, dtype=torch.int32)
    args["top_p"] = torch.rand(512, generator=gen)
    args["min_p"] = torch.rand(512, generator=gen) * 0.5
    args["top_p"][0] = 0.0
    tokens = sample_ref(**args)
    assert tokens[0] == logits[0].argmax()
    k = torch.where(args["top_k"] > 0, args["top_k"], 64)
    assert (rank_of(logits, tokens) < k).all()
    chosen = probs.gather(1, tokens[:, None]).flatten()
    assert (chosen >= args["min_p"] * probs.max(-1).values - 1e-7).all()


def rank_of(logits, tokens):
    order = logits.argsort(-1, descending=True)
    return (order == tokens[:, None]).float().argmax(-1)


def test_seeded_rows_do_not_depend_on_batch():
    gen = torch.Generator().manual_seed(1)
    row = torch.randn(1, 100, generator=gen)
    seeds = torch.tensor([1234, 99, 2**40 + 7], dtype=torch.int64)
    positions = torch.tensor([3, 0, 17], dtype=torch.int64)
    alone = [
        sample_ref(**_sampling_args(row, top_p=0.9, top_k=40, seeds=seeds[i : i + 1], positions=positions[i : i + 1]))
        for i in range(3)
    ]
    others = torch.randn(4, 100, generator=gen)
    logits = torch.cat([others[:2], row, others[2:3], row, row, others[3:]])
    batch_seeds = torch.tensor([5, 6, 1234, 7, 99, 2**40 + 7, 8])
    batch_pos = torch.tensor([0, 1, 3, 2, 0, 17, 4])
    args = _sampling_args(logits, top_p=0.9, top_k=40, seeds=batch_seeds, positions=batch_pos)
    args["temperature"][0] = 0.0  # a greedy neighbour too
    tokens = sample_ref(**args)
    assert tokens[[2, 4, 5]].tolist() == [t.item() for t in alone]
    # ... and a different position of the same seed draws fresh noise.
    many = sample_ref(**_sampling_args(row.expand(64, -1), seeds=torch.full((64,), 1234), positions=torch.arange(64)))
    assert len(set(many.tolist())) > 10


def test_sampling_distribution():
    target = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 8000
    logits = target.log().expand(n, -1).contiguous()
    tokens = sample_ref(**_sampling_args(logits, seeds=torch.arange(n) * 7919, positions=torch.arange(n) % 13))
    freq = torch.bincount(tokens, minlength=4).float() / n
    torch.testing.assert_close(freq, target, atol=0.025, rtol=0)
    # Temperature 0.5 squares the odds: p_i ∝ target_i ** 2.
    hot = sample_ref(**_sampling_args(logits, temperature=0.5, seeds=torch.arange(n) + 10**6))
    sharp = target**2 / (target**2).sum()
    freq = torch.bincount(hot, minlength=4).float() / n
    torch.testing.assert_close(freq, sharp, atol=0.025, rtol=0)
    # top_k=2 renormalises over the two most likely tokens.
    top2 = sample_ref(**_sampling_args(logits, top_k=2, seeds=torch.arange(n) + 10**7))
    freq = torch.bincount(top2, minlength=4).float() / n
    torch.testing.assert_close(freq, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.025, rtol=0)
