"""The oracle's self-checks: ``reference.py`` against independent computations of the same
definitions (torch's SDPA on each request's dense tensors, the truncation rules worked by hand),
since every kernel test trusts it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from actorlm.kernels.reference import paged_attention_ref, write_kv_ref
from paged_batches import dtype_id
from sampling_checks import LOGITS, greedy_case, oracle_probs, sampling_params
from tolerance import assert_within, attention_error, sum_error

# (q_len, seq_len) per request: decodes, fresh prefills, and prefill chunks over cached context.
BATCHES = {
    "decodes": [(1, 1), (1, 7), (1, 33), (1, 16), (1, 50)],
    "prefills": [(5, 5), (1, 1), (17, 17), (3, 3)],
    "mixed": [(1, 9), (6, 20), (1, 1), (13, 13), (4, 37), (1, 64), (2, 2), (9, 15)],
}
ARG_NAMES = ("query", "k_cache", "v_cache", "block_tables", "query_start_loc", "seq_lens")


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


def _dense(q, k, v):
    """One request's float64 tensors for SDPA and the bound: the KV heads repeated per query
    head, and which positions each query row sees (the last L of S positions query)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    q_len, seq_len = q.shape[0], k.shape[0]
    visible = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
    return q.double(), k, v, visible  # [L, Hq, D], [S, Hq, D], [S, Hq, D], [L, S]


def _sdpa(q, k, v, visible, scale):
    """torch's SDPA in float64 on one request's dense tensors -> [L, Hq, D]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=visible, scale=scale)
    return out.transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (4, 2), (8, 2)])
@pytest.mark.parametrize("head_dim", [48, 64])
@pytest.mark.parametrize("batch_name", sorted(BATCHES))
def test_paged_attention_ref_is_sdpa_request_by_request(batch_name, head_dim, num_heads,
                                                        num_kv_heads, block_size, dtype):
    batch = BATCHES[batch_name]
    case = _paged_case(batch, num_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    args = [case[name] for name in ARG_NAMES]
    out = paged_attention_ref(*args, scale)
    assert out.shape == case["query"].shape and out.dtype == dtype
    for (q, k, v), start, end in zip(case["per_request"], case["query_start_loc"][:-1].tolist(),
                                     case["query_start_loc"][1:].tolist()):
        q, k, v, visible = _dense(q, k, v)
        expected = _sdpa(q, k, v, visible, scale)
        # both sides in float64 (each its own order), the oracle's result rounded to dtype
        bound = attention_error(q, k, v, scale, visible, expected, torch.float64, output=dtype) + \
            attention_error(q, k, v, scale, visible, expected, torch.float64)
        assert_within(out[start:end], expected, bound, f"request at rows {start}:{end}")
    # Host-side maxima given by the caller must not change the result.
    hinted = paged_attention_ref(
        *args, scale, max_query_len=max(q for q, _ in batch), max_seq_len=max(s for _, s in batch)
    )
    assert torch.equal(hinted, out)


def test_paged_attention_ref_is_independent_of_batch_neighbours():
    # The same request alone and inside a ragged batch: padded query rows must not leak.
    case = _paged_case(BATCHES["mixed"], 4, 2, 32, 4, torch.float32)
    out = paged_attention_ref(*[case[name] for name in ARG_NAMES], 0.2)
    b = 3  # a fresh 13-token prefill between decodes and a chunk over cached context
    start, end = case["query_start_loc"][b : b + 2].tolist()
    alone = paged_attention_ref(
        case["query"][start:end], case["k_cache"], case["v_cache"], case["block_tables"][b : b + 1],
        torch.tensor([0, end - start], dtype=torch.int32), case["seq_lens"][b : b + 1], 0.2,
    )  # fmt: skip
    q, k, v, visible = _dense(*case["per_request"][b])
    # both float64 (their orders may differ), each rounded once to fp32
    bound = 2 * attention_error(q, k, v, 0.2, visible, alone, torch.float64)
    assert_within(out[start:end], alone, bound, "alone vs in the batch")


def test_write_kv_ref_writes_each_slot_and_skips_negative_ones():
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


def _kept(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """The token ids ``sampling_probs_ref`` keeps of ``LOGITS`` under these parameters."""
    params = sampling_params(1, temperature, top_k, top_p, min_p)
    return (oracle_probs(LOGITS[None], params)[0] > 0).nonzero().flatten().tolist()


def test_sampling_probs_ref_truncates_as_defined():
    # top-p 0.7 keeps 0.3, 0.2, 0.15, 0.1 (0.65 < 0.7 <= 0.75).
    assert _kept(top_p=0.7) == [1, 3, 6, 8]
    assert _kept(min_p=0.25) == [1, 3, 5, 6, 8]  # p >= 0.075
    assert _kept(top_k=4) == [1, 3, 6, 8]
    # At T=1.3 the top-6 set, renormalised, reaches 0.8 at four tokens (the full distribution
    # would need five); min-p 0.3 keeps five, so top-p decides.
    assert _kept(1.3, 6, 0.8, 0.3) == [1, 3, 6, 8]
    assert _kept(1.3, 6, 0.9, 0.5) == [1, 3, 6]  # top-p keeps five, min-p three


def test_sampling_probs_ref_renormalises_what_it_keeps():
    probs = oracle_probs(LOGITS[None], sampling_params(1, temperature=0.5, top_k=4))[0]
    sharp = torch.softmax(LOGITS.double() / 0.5, -1)  # temperature 0.5 squares the odds
    kept = [1, 3, 6, 8]
    expected = torch.zeros_like(probs)
    expected[kept] = sharp[kept] / sharp[kept].sum()
    # each side: a softmax over V terms, then a renormalisation over the kept ones, in float64
    assert_within(probs, expected, 4 * sum_error(LOGITS.numel(), expected, torch.float64), "probs")


def test_sampling_probs_ref_puts_a_greedy_row_on_its_lowest_argmax():
    logits, params = greedy_case()
    probs = oracle_probs(logits, params)
    assert torch.equal(probs.max(-1).values, torch.ones(logits.shape[0], dtype=torch.float64))
    assert probs[:4].argmax(-1).tolist() == [7, 0, 0, 5]
