"""The CPU attention path (``cpu_attention`` planning, ``decode_attention``'s C++ decode kernel)
against paged_attention_ref, within the bound of ``paged_batches``: the C++ kernel keeps scores,
P and sums in fp32 (bf16 inputs widened exactly); torch's SDPA rounds P to bf16 for P @ V.

The decode kernel is built on first use with the machine's compiler; this suite's set-up has
one, so the kernel must build here (a silent fall-back would leave it untested)."""

from __future__ import annotations

import pytest
import torch

from actorlm.kernels.cpu import attention as cpu_attention, decode_attention
from actorlm.kernels.cpu.attention import attend, plan_attention
from actorlm.kernels.reference import paged_attention_ref
from paged_batches import MIXED_BATCH, assert_matches_reference, dtype_id, make_batch


def _plan_lists(block_tables, query_start_loc, seq_lens, block_size):
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    seq_lens = seq_lens.tolist()
    block_ids = [row[:-(-s // block_size)] for row, s in zip(block_tables.tolist(), seq_lens)]
    return q_lens, seq_lens, block_ids


def _attend(inputs, scale):
    query, k_cache, v_cache, block_tables, query_start_loc, seq_lens = inputs
    plan = plan_attention(*_plan_lists(block_tables, query_start_loc, seq_lens,
                                       k_cache.shape[1]), k_cache.shape[1])
    return plan, attend(query, k_cache, v_cache, plan, scale)


def test_the_kernel_builds_here():
    assert decode_attention.is_built(16)
    assert decode_attention.supports(torch.bfloat16, 9, 3, 64, 16)
    assert decode_attention.supports(torch.float32, 32, 8, 128, 16)
    assert not decode_attention.supports(torch.float16, 4, 2, 64, 16)  # the torch path's


def test_building_it_leaves_denormals_alone():
    # -ffast-math must not reach the link step (crtfastmath.o would flush denormals to zero
    # for the whole process)
    decode_attention.is_built(16)
    assert (torch.tensor([1e-38]) / 1e3).item() > 0


@pytest.mark.parametrize(
    "dtype, head_dim, num_kv_heads, gqa, block_size",
    [
        (torch.float32, 64, 3, 3, 16),  # SmolLM2's shape
        (torch.float32, 80, 1, 8, 32),
        (torch.float32, 128, 2, 1, 16),
        (torch.bfloat16, 64, 3, 3, 16),
        (torch.bfloat16, 96, 2, 7, 32),
        (torch.bfloat16, 128, 1, 4, 64),
        (torch.bfloat16, 64, 2, 8, 16),  # the most query heads a KV head has in registers
        (torch.float32, 64, 1, 16, 16),  # more: the portable path, head size still fixed
    ],
    ids=dtype_id,
)
def test_decode_kernel_matches_reference(dtype, head_dim, num_kv_heads, gqa, block_size):
    # contexts of one token, a block minus one, a block, a block plus one, and long ones
    lens = [(1, c) for c in (0, block_size - 2, block_size - 1, block_size, 150, 333)]
    inputs = make_batch(lens, num_kv_heads * gqa, num_kv_heads, head_dim, block_size, dtype,
                        seed=head_dim + gqa)
    query, k_cache, v_cache, block_tables, _, seq_lens = inputs
    out = decode_attention.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens,
                                            head_dim**-0.5)
    assert_matches_reference(out, inputs, head_dim**-0.5)  # fp32 scores, P and sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("head_dim", [64, 80])  # the AVX-512 item, and the portable one
def test_decode_kernel_reads_fp8_caches(dtype, cache_dtype, head_dim):
    # --kv-cache-dtype fp8: the kernel widens each cached value exactly (subnormals too) and
    # attends as over the model's dtype
    lens = [(1, c) for c in (1, 15, 150, 333)]
    query, k_cache, v_cache, block_tables, start_loc, seq_lens = make_batch(
        lens, 6, 2, head_dim, 16, dtype, seed=7)
    k_cache, v_cache = ((c.float() * torch.exp2(torch.randint(-12, 4, c.shape[-1:]).float())
                         ).to(cache_dtype) for c in (k_cache, v_cache))
    assert decode_attention.supports(dtype, 6, 2, head_dim, 16, cache_dtype)
    out = decode_attention.paged_decode_attention(query, k_cache, v_cache, block_tables,
                                                  seq_lens, head_dim**-0.5)
    inputs = (query, k_cache, v_cache, block_tables, start_loc, seq_lens)
    assert_matches_reference(out, inputs, head_dim**-0.5)  # fp32 scores, P and sums


def test_decode_kernel_reads_strided_rows_and_writes_only_them():
    # query rows as a view into a fused projection; rows 0 and 2 decode, row 1 is not touched
    lens = [(1, 20), (1, 7), (1, 64)]
    inputs = make_batch(lens, 6, 2, 64, 16, torch.float32, seed=3)
    query, k_cache, v_cache, block_tables, _, seq_lens = inputs
    fused = torch.randn(3, 10, 64)
    fused[:, :6] = query
    rows = torch.tensor([0, 2], dtype=torch.int32)
    out = torch.full((3, 6, 64), 7.0)
    decode_attention.paged_decode_attention(fused[:, :6], k_cache, v_cache, block_tables[[0, 2]],
                                      seq_lens[[0, 2]], 0.125, rows, out)
    assert_matches_reference(out, inputs, 0.125, rows=[0, 2])  # fp32 throughout
    assert torch.equal(out[1], torch.full((6, 64), 7.0))


def test_decode_kernel_sees_only_the_context():
    # cache positions past a request's seq_len (the rest of its last block) are never read
    inputs = make_batch([(1, 9)], 2, 1, 64, 16, torch.float32, seed=4)
    query, k_cache, v_cache, block_tables, _, seq_lens = inputs
    before = decode_attention.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125)
    k_cache[int(block_tables[0, 0]), 10:] = float("nan")
    v_cache[int(block_tables[0, 0]), 10:] = float("nan")
    after = decode_attention.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125)
    assert torch.equal(before, after)


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_planned_mixed_batch_matches_reference(dtype, use_kernel, monkeypatch):
    if not use_kernel:
        monkeypatch.setattr(cpu_attention.decode_attention, "is_built", lambda block_size: False)
    inputs = make_batch(MIXED_BATCH, 6, 2, 64, 16, dtype, seed=11)
    plan, out = _attend(inputs, 0.125)
    assert (plan.decode is not None) == use_kernel
    assert_matches_reference(out, inputs, 0.125, probs=dtype)  # SDPA rounds P to the dtype


def test_a_shape_beyond_the_kernel_falls_back_to_groups(monkeypatch):
    # planned for the kernel, but this layer's shape is not one it runs: the decode rows'
    # groups are built then, and the result is the same
    monkeypatch.setattr(cpu_attention.decode_attention, "supports", lambda *args: False)
    inputs = make_batch(MIXED_BATCH, 6, 2, 64, 16, torch.float32, seed=12)
    plan, out = _attend(inputs, 0.125)
    assert plan.decode is not None
    assert_matches_reference(out, inputs, 0.125)  # fp32 throughout


@pytest.mark.parametrize("window", [None, 12], ids=["full", "window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_sinks_join_each_heads_softmax(dtype, window):
    """GPT-OSS's attention sinks, one logit per query head (one far above every score, one far
    below), over prefills and decodes (these on the torch path: the C++ kernel has no sinks),
    GQA, with and without a window: within the bound, and each sink's term more than it."""
    inputs = make_batch(MIXED_BATCH, 6, 2, 64, 16, dtype, seed=13)
    query, k_cache, v_cache, block_tables, query_start_loc, seq_lens = inputs
    sinks = torch.tensor([0.5, -1.0, 6.0, 2.0, -30.0, 1.5])
    plan = plan_attention(*_plan_lists(block_tables, query_start_loc, seq_lens, 16), 16)
    out = attend(query, k_cache, v_cache, plan, 0.125, window, sinks=sinks)
    assert_matches_reference(out, inputs, 0.125, window=window, sinks=sinks)
    without = paged_attention_ref(*inputs, 0.125, window=window)
    moved = (out.double() - without.double()).abs().amax(dim=(0, 2))  # per head
    assert (moved[[0, 1, 2, 3, 5]] > 1e-2).all() and moved[4] < 1e-6  # (-30: nothing)


def test_a_plain_decode_step_costs_each_request_its_own_context():
    # one long context among short ones: the kernel takes every decode row in one call, with
    # no groups (nothing padded to the longest)
    lens = [(1, 5)] * 7 + [(1, 900)]
    inputs = make_batch(lens, 4, 2, 64, 16, torch.float32, seed=13)
    plan, out = _attend(inputs, 0.125)
    assert plan.groups == [] and plan.decode.rows is None
    assert_matches_reference(out, inputs, 0.125)  # fp32 throughout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("lens", [[3000], [9, 2500, 40, 700, 1]], ids=["alone", "among-short"])
def test_a_long_context_is_split_over_the_threads_and_merged(dtype, lens):
    # past a quarter of a thread's share, a context is cut into spans attended apart and merged
    inputs = make_batch([(1, c - 1) for c in lens], 6, 2, 64, 16, dtype, seed=len(lens))
    query, k_cache, v_cache, block_tables, _, seq_lens = inputs
    out = decode_attention.paged_decode_attention(query, k_cache, v_cache, block_tables, seq_lens, 0.125)
    assert_matches_reference(out, inputs, 0.125)  # fp32 scores, P, sums and merge
    plan, planned = _attend(inputs, 0.125)
    assert plan.groups == [] and plan.decode is not None  # no torch path for the long one
    assert torch.equal(planned, out)
