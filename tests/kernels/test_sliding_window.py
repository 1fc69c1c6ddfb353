"""A sliding window and capped scores in every attention path: the CPU torch path (planned
groups), the C++ decode kernel, and Triton (interpreted on the CPU), each against
``paged_attention_ref`` (float64) within the bound of ``paged_batches``.

Under a window the allocator frees the blocks a request's window no longer reaches, and
another request may take them: so each path is also run on a batch whose unread blocks are
NaN and whose freed table entries name block 0 or another request's block
(``window_batches.with_freed_blocks``), and must give what it gives on the clean batch.
"""

from __future__ import annotations

import pytest
import torch

from actorlm.kernels.cpu import attention as cpu_attention, decode_attention
from actorlm.kernels.cpu.attention import attend, plan_attention
from actorlm.kernels.reference import paged_attention_ref
from actorlm.kernels.triton.paged_attention import paged_attention
from paged_batches import assert_matches_reference, dtype_id, make_batch
from window_batches import WINDOW, WINDOW_BATCH, with_freed_blocks

SOFTCAP = 3.0  # scores of these batches reach ~4: the cap bends them
# (window, softcap): each alone, both, and a window of one position (a query sees itself)
OPTIONS = [(WINDOW, None), (None, SOFTCAP), (WINDOW, SOFTCAP), (1, None)]


def options_id(value):
    if isinstance(value, tuple):
        return f"window{value[0]}-cap{value[1]}"
    return dtype_id(value)


def _cpu_attend(inputs, scale, window, softcap):
    query, k_cache, v_cache, block_tables, query_start_loc, seq_lens = inputs
    block_size = k_cache.shape[1]
    q_lens, lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist(), seq_lens.tolist()
    block_ids = [row[:-(-s // block_size)] for row, s in zip(block_tables.tolist(), lens)]
    plan = plan_attention(q_lens, lens, block_ids, block_size)
    return plan, attend(query, k_cache, v_cache, plan, scale, window, softcap)


def _decode(inputs, scale, window, softcap):
    query, k_cache, v_cache, block_tables, _, seq_lens = inputs
    return decode_attention.paged_decode_attention(query, k_cache, v_cache, block_tables,
                                                   seq_lens, scale, window=window,
                                                   softcap=softcap)


def test_the_window_and_the_cap_change_what_the_batch_attends():
    # so that a path ignoring either fails the tests below
    inputs = make_batch(WINDOW_BATCH, 6, 2, 64, 16, torch.float32, seed=1)
    full = paged_attention_ref(*inputs, 0.125)
    for window, softcap in OPTIONS:
        changed = paged_attention_ref(*inputs, 0.125, window=window, softcap=softcap)
        assert (changed - full).abs().max() > 0.05


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("options", OPTIONS, ids=options_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_cpu_mixed_batch_matches_reference(dtype, options, use_kernel, monkeypatch):
    if not use_kernel:
        monkeypatch.setattr(cpu_attention.decode_attention, "is_built", lambda block_size: False)
    inputs = make_batch(WINDOW_BATCH, 6, 2, 64, 16, dtype, seed=21)
    plan, out = _cpu_attend(inputs, 0.125, *options)
    assert (plan.decode is not None) == use_kernel
    # SDPA rounds P to the dtype (the capped path and the kernel keep it in fp32)
    assert_matches_reference(out, inputs, 0.125, probs=dtype, window=options[0],
                             softcap=options[1])


@pytest.mark.parametrize("use_kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_cpu_path_never_reads_a_block_outside_the_window(block_size, use_kernel, monkeypatch):
    if not use_kernel:
        monkeypatch.setattr(cpu_attention.decode_attention, "is_built", lambda block_size: False)
    inputs = make_batch(WINDOW_BATCH, 8, 2, 64, block_size, torch.float32, seed=block_size)
    poisoned, clean, num_freed = with_freed_blocks(inputs, WINDOW)
    assert num_freed >= 3  # both kinds: block 0 and a block another request reads
    _, out = _cpu_attend(poisoned, 0.125, WINDOW, SOFTCAP)
    assert_matches_reference(out, clean, 0.125, window=WINDOW, softcap=SOFTCAP)
    assert torch.equal(out, _cpu_attend(clean, 0.125, WINDOW, SOFTCAP)[1])


def test_cpu_shape_beyond_the_kernel_falls_back_to_windowed_groups(monkeypatch):
    monkeypatch.setattr(cpu_attention.decode_attention, "supports", lambda *args: False)
    inputs = make_batch(WINDOW_BATCH, 6, 2, 64, 16, torch.float32, seed=22)
    poisoned, clean, _ = with_freed_blocks(inputs, WINDOW)
    plan, out = _cpu_attend(poisoned, 0.125, WINDOW, None)
    assert plan.decode is not None
    assert_matches_reference(out, clean, 0.125, window=WINDOW)  # fp32 throughout


def test_cpu_window_past_every_context_reuses_the_full_plan():
    inputs = make_batch(WINDOW_BATCH, 6, 2, 64, 16, torch.float32, seed=23)
    plan, out = _cpu_attend(inputs, 0.125, 200, None)
    assert plan.windowed(200) is None and plan.windowed(WINDOW) is not None
    assert torch.equal(out, _cpu_attend(inputs, 0.125, None, None)[1])


@pytest.mark.parametrize(
    "dtype, head_dim, num_kv_heads, gqa, block_size",
    [
        (torch.float32, 64, 3, 3, 16),  # AVX-512 items
        (torch.float32, 80, 1, 8, 32),  # the portable item
        (torch.bfloat16, 128, 1, 4, 16),
        (torch.bfloat16, 96, 2, 7, 32),
        (torch.float32, 64, 1, 16, 16),  # more query heads a KV head than registers hold
    ],
    ids=dtype_id,
)
@pytest.mark.parametrize("options", OPTIONS, ids=options_id)
def test_decode_kernel_matches_reference(dtype, head_dim, num_kv_heads, gqa, block_size,
                                         options):
    # contexts within the window, at its edge, and past it by less and more than a block
    lens = [(1, c) for c in (0, WINDOW - 2, WINDOW - 1, WINDOW, WINDOW + 1, 150, 333)]
    inputs = make_batch(lens, num_kv_heads * gqa, num_kv_heads, head_dim, block_size, dtype,
                        seed=head_dim + gqa)
    out = _decode(inputs, head_dim**-0.5, *options)
    assert_matches_reference(out, inputs, head_dim**-0.5, window=options[0],
                             softcap=options[1])  # fp32 scores, P and sums


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("lens", [[3000], [9, 2500, 40, 700, 1]], ids=["alone", "among-short"])
def test_decode_kernel_splits_a_long_window_and_never_reads_before_it(dtype, lens):
    # a window of 1,000 (not block aligned) is still long enough to be cut into spans
    window = 1000 + 7
    inputs = make_batch([(1, c - 1) for c in lens], 6, 2, 64, 16, dtype, seed=len(lens))
    poisoned, clean, num_freed = with_freed_blocks(inputs, window)
    assert num_freed > 90
    out = _decode(poisoned, 0.125, window, SOFTCAP)
    assert_matches_reference(out, clean, 0.125, window=window, softcap=SOFTCAP)
    assert torch.equal(out, _decode(clean, 0.125, window, SOFTCAP))


def test_decode_kernel_never_reads_a_block_outside_the_window():
    lens = [(1, c) for c in (5, WINDOW + 3, 64, 150, 333)]
    inputs = make_batch(lens, 6, 2, 64, 16, torch.bfloat16, seed=24)
    poisoned, clean, _ = with_freed_blocks(inputs, WINDOW)
    out = _decode(poisoned, 0.125, WINDOW, None)
    assert_matches_reference(out, clean, 0.125, window=WINDOW)
    assert torch.equal(out, _decode(clean, 0.125, WINDOW, None))


@pytest.mark.parametrize(
    "dtype, gqa, block_size, num_kv_splits",
    [
        (torch.float32, 3, 16, 1),  # a chunk of 37 queries: three tiles, three windows
        (torch.bfloat16, 1, 32, 1),
        (torch.float16, 8, 16, 1),
        (torch.float32, 3, 16, 3),  # split KV: each split's share of the window
    ],
    ids=dtype_id,
)
@pytest.mark.parametrize("options", OPTIONS[:3], ids=options_id)
def test_triton_mixed_batch_matches_reference(dtype, gqa, block_size, num_kv_splits, options):
    inputs = make_batch(WINDOW_BATCH, 2 * gqa, 2, 32, block_size, dtype, seed=gqa + block_size)
    out = paged_attention(*inputs, 32**-0.5, num_kv_splits=num_kv_splits, window=options[0],
                          softcap=options[1])
    # fp32 scores and sums, P rounded to the input dtype before P @ V
    assert_matches_reference(out, inputs, 32**-0.5, probs=dtype, window=options[0],
                             softcap=options[1])


@pytest.mark.parametrize("num_kv_splits", [1, 2])
def test_triton_never_reads_a_block_outside_the_window(num_kv_splits):
    inputs = make_batch(WINDOW_BATCH, 6, 2, 32, 16, torch.float32, seed=25)
    poisoned, clean, _ = with_freed_blocks(inputs, WINDOW)
    out = paged_attention(*poisoned, 0.125, num_kv_splits=num_kv_splits, window=WINDOW,
                          softcap=SOFTCAP)
    assert_matches_reference(out, clean, 0.125, window=WINDOW, softcap=SOFTCAP)
