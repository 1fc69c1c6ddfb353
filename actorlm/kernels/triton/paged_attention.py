"""Triton attention over the paged KV cache (``write_kv.py`` writes new K/V into its slots).

``paged_attention`` runs one kernel over a flattened batch that mixes prefill chunks (whose
requests may already have cached context) and decodes. Each program owns one request, one
tile of its queries and one KV head; the query heads that share that KV head are packed into
the rows of the tile (GQA), so a decode with 8 query heads per KV head still fills a 16-row
``tl.dot``. Keys and values are gathered token by token through the block table, so the KV
tile size does not depend on the cache block size. Softmax is online, in fp32, in base 2.

Long decode contexts can be split over several programs (flash-decoding): each split writes
an unnormalised partial result with its running max and sum, and a second kernel merges them.

A sliding window starts a tile's KV range at the first position its earliest query sees: the
positions before it are never loaded, nor their block-table entries (the allocator frees those
blocks; the entries may name any block), and the rest of the window is masked per query. A
score cap (Gemma 2's ``softcap * tanh(s / softcap)``) applies to the scaled scores before the
mask. Attention sinks (GPT-OSS: a logit per query head that joins its softmax's denominator
with no value) are added once, where the sum is normalised: at the end of the KV loop, or in the
merge of the splits. All three are constexpr switches, so a layer without them compiles the
kernel as before.

The oracle is ``paged_attention_ref`` in ``reference.py``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634
_LOG2E_IN_KERNEL = tl.constexpr(_LOG2E)  # the sinks come in natural-log units
_BLOCK_N = 32  # KV tokens per inner-loop step
_MAX_KV_SPLITS = 16
_MIN_KV_PER_SPLIT = 256

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _dot(a, b, IN_FP32: tl.constexpr):
    # fp32 operands use exact (ieee) products: tf32 would miss the fp32 tolerance.
    # IN_FP32 upcasts 16-bit operands (the CPU interpreter multiplies bf16 as raw bits).
    if IN_FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif a.dtype == tl.float32:
        out = tl.dot(a, b, input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): exact at both ends (e^2x overflowing to inf gives 1), and absolutely
    # accurate to a few ulps near 0, which is what the softmax of the capped scores needs
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _sink_in_sum(m, l, sink):
    """(the sum's scale, the new sum) once the sink's score (log2 units) joins a running max m and
    sum l: both taken to max(m, sink) first, so that a sink above every score cannot overflow
    exp2; the caller multiplies its unnormalised output by the scale."""
    m_new = tl.maximum(m, sink)
    rescale = tl.exp2(m - m_new)
    return rescale, l * rescale + tl.exp2(sink - m_new)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, D]; unused when NUM_SPLITS > 1
    part_acc_ptr,  # [T, Hq, NUM_SPLITS, HEAD_DIM_PAD] fp32; used when NUM_SPLITS > 1
    part_ml_ptr,  # [T, Hq, NUM_SPLITS, 2] fp32 (running max in log2 units, running sum)
    q_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # [B, max_blocks] int32
    query_start_loc_ptr,  # [B + 1] int32
    seq_lens_ptr,  # [B] int32
    sinks_ptr,  # [Hq] fp32 (with HAS_SINKS)
    scale_log2,  # softmax scale * log2(e)
    window,  # positions each query sees (with HAS_WINDOW)
    softcap_log2,  # the score cap * log2(e) (with HAS_SOFTCAP)
    num_heads,  # Hq
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    NUM_QUERIES_PER_KV: tl.constexpr,
    QPK_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,  # = BLOCK_Q * QPK_PAD rows: (query token, query head of the group)
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq_idx = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS

    q_start = tl.load(query_start_loc_ptr + seq_idx)
    q_len = tl.load(query_start_loc_ptr + seq_idx + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq_idx)
    context_len = seq_len - q_len  # tokens cached before this step's queries

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_tile * BLOCK_Q + offs_m // QPK_PAD  # [BLOCK_M] query index within the request
    head_in_group = offs_m % QPK_PAD
    q_head = kv_head * NUM_QUERIES_PER_KV + head_in_group  # [BLOCK_M]
    row_mask = (q_idx < q_len) & (head_in_group < NUM_QUERIES_PER_KV)
    q_pos = context_len + q_idx  # [BLOCK_M] absolute position: sees kv 0..q_pos
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM

    q_rows = (q_start + q_idx).to(tl.int64) * stride_qt + q_head * stride_qh  # [BLOCK_M]
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_mask[:, None] & d_mask[None, :], other=0.0)

    # KV range this tile needs (from its first query's window); a split takes a contiguous
    # share of whole BLOCK_N steps.
    kv_stop = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
    kv_start = 0
    if HAS_WINDOW:
        kv_start = tl.maximum(0, context_len + q_tile * BLOCK_Q - window + 1)
    if NUM_SPLITS > 1:
        steps_per_split = tl.cdiv(tl.cdiv(kv_stop - kv_start, BLOCK_N), NUM_SPLITS)
        kv_start = kv_start + split * steps_per_split * BLOCK_N
        kv_stop = tl.minimum(kv_stop, kv_start + steps_per_split * BLOCK_N)

    # A finite floor keeps fully masked rows free of inf - inf.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + seq_idx.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_stop, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] absolute kv positions
        n_mask = offs_n < kv_stop
        block_ids = tl.load(table_row + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = offs_n % BLOCK_SIZE
        kv_mask = d_mask[:, None] & n_mask[None, :]  # [HEAD_DIM_PAD, BLOCK_N]
        k_off = block_ids * stride_kb + in_block * stride_ks + kv_head * stride_kh  # [BLOCK_N]
        # [D, N]; an FP8 cache's values widened (exactly) to q's dtype
        k = tl.load(k_cache_ptr + k_off[None, :] + offs_d[:, None], mask=kv_mask, other=0.0).to(q.dtype)

        s = _dot(q, k, DOT_IN_FP32) * scale_log2  # [BLOCK_M, BLOCK_N]
        if HAS_SOFTCAP:  # softcap * tanh(s / softcap), on the scores in log2 units
            s = _tanh(s / softcap_log2) * softcap_log2
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if HAS_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_off = block_ids * stride_vb + in_block * stride_vs + kv_head * stride_vh  # [BLOCK_N]
        v_mask = n_mask[:, None] & d_mask[None, :]  # [BLOCK_N, HEAD_DIM_PAD]
        v = tl.load(v_cache_ptr + v_off[:, None] + offs_d[None, :], mask=v_mask, other=0.0).to(q.dtype)  # [N, D]
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_IN_FP32)
        m_i = m_new

    if NUM_SPLITS == 1:
        if HAS_SINKS:  # (split partials leave the sink to the merge, which counts it once)
            sink = tl.load(sinks_ptr + q_head, mask=row_mask, other=0.0) * _LOG2E_IN_KERNEL
            rescale, l_i = _sink_in_sum(m_i, l_i, sink)
            acc = acc * rescale[:, None]
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        o_rows = (q_start + q_idx).to(tl.int64) * stride_ot + q_head * stride_oh
        tl.store(
            out_ptr + o_rows[:, None] + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )
    else:
        # Partials are contiguous: [T, Hq, NUM_SPLITS, ...].
        part = ((q_start + q_idx).to(tl.int64) * num_heads + q_head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], acc, mask=row_mask[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_mask)


@triton.jit
def _merge_kv_splits_kernel(
    out_ptr,  # [T, Hq, D]
    part_acc_ptr,  # [T, Hq, NUM_SPLITS, HEAD_DIM_PAD] fp32
    part_ml_ptr,  # [T, Hq, NUM_SPLITS, 2] fp32
    sinks_ptr,  # [Hq] fp32 (with HAS_SINKS)
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    s_mask = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    part = (token * NUM_HEADS + head) * NUM_SPLITS + offs_s  # [SPLITS_PAD]

    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=-1.0e30)
    l = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    weight = tl.exp2(m - m_max)  # [SPLITS_PAD]; empty splits weigh 0
    total = tl.sum(weight * l, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head) * _LOG2E_IN_KERNEL
        rescale, total = _sink_in_sum(m_max, total, sink)
        weight = weight * rescale
    out = tl.sum(acc * weight[:, None], axis=0) / total  # [HEAD_DIM_PAD]
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@functools.lru_cache(maxsize=8)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _choose_num_kv_splits(device: torch.device, num_programs: int, max_seq_len: int | None,
                          seq_lens: torch.Tensor) -> int:
    """Split the KV range only when the grid leaves most SMs idle and contexts are long."""
    if device.type != "cuda":
        return 1
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if num_programs >= num_sms:
        return 1
    by_length = max_seq_len // _MIN_KV_PER_SPLIT
    return max(1, min(_MAX_KV_SPLITS, by_length, triton.cdiv(2 * num_sms, num_programs)))


def _check_layouts(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                   sinks) -> None:
    assert query.dim() == 3 and k_cache.dim() == 4 and k_cache.shape == v_cache.shape
    num_heads, head_dim = query.shape[1:]
    num_kv_heads, cache_dim = k_cache.shape[2:]
    assert cache_dim == head_dim, (query.shape, k_cache.shape)
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads for {num_kv_heads} KV heads"
    assert query.dtype in _FLOAT_DTYPES and k_cache.dtype == v_cache.dtype and \
        k_cache.dtype in (query.dtype, torch.float8_e4m3fn, torch.float8_e5m2), (
            query.dtype, k_cache.dtype, v_cache.dtype)
    for t in (query, k_cache, v_cache):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.shape == (num_seqs + 1,), (query_start_loc.shape, num_seqs)
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs, block_tables.shape
    assert block_tables.stride(1) == 1
    for t in (block_tables, query_start_loc, seq_lens):
        assert t.dtype == torch.int32, t.dtype
        assert t.device == query.device
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.dtype == torch.float32, (
            f"sinks: [{num_heads}] fp32 wanted, got {tuple(sinks.shape)} {sinks.dtype}")
        assert sinks.stride(0) == 1 and sinks.device == query.device


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_kv_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a flattened batch of queries over the paged KV cache.

    query: [T, Hq, D] (Hq a multiple of Hkv); k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    block_tables: [B, max_blocks] int32; query_start_loc: [B + 1] int32; seq_lens: [B] int32.
    Request b's queries are the last q_len_b of its seq_lens[b] tokens, whose K/V are all cached.
    With a ``window``, the query at position p sees positions p - window + 1 .. p only (and
    nothing before its request's earliest window is read); a ``softcap`` caps the scaled scores
    at ``softcap * tanh(s / softcap)``. ``sinks`` [Hq] fp32: each head's softmax also counts
    exp(sinks[h]) in its denominator, a score no value goes with (GPT-OSS's attention sinks).
    Returns [T, Hq, D] in query's dtype. ``num_kv_splits`` forces the number of KV splits (None:
    chosen from the grid size and ``max_seq_len``).
    """
    _check_layouts(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, sinks)
    assert window is None or window > 0, window
    assert softcap is None or softcap > 0, softcap
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    out = torch.empty_like(query)  # [T, Hq, D]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_query_len <= 0:
        return out

    queries_per_kv = num_heads // num_kv_heads
    qpk_pad = triton.next_power_of_2(queries_per_kv)
    # At least 16 rows (tl.dot's minimum), up to 64 when there are that many queries.
    block_m = max(16, qpk_pad, min(64, triton.next_power_of_2(max_query_len) * qpk_pad))
    block_q = block_m // qpk_pad
    num_q_tiles = triton.cdiv(max_query_len, block_q)
    head_dim_pad = triton.next_power_of_2(head_dim)

    if num_kv_splits is None:
        if window is not None:  # what a decode reads
            max_seq_len = min(window, max_seq_len or int(seq_lens.max()))
        num_kv_splits = _choose_num_kv_splits(query.device, num_seqs * num_q_tiles * num_kv_heads,
                                              max_seq_len, seq_lens)
    assert num_kv_splits >= 1

    if num_kv_splits > 1:
        part_acc = torch.empty(  # [T, Hq, S, D_pad]
            (num_tokens, num_heads, num_kv_splits, head_dim_pad), dtype=torch.float32, device=query.device)
        part_ml = torch.empty(  # [T, Hq, S, 2]
            (num_tokens, num_heads, num_kv_splits, 2), dtype=torch.float32, device=query.device)
    else:
        part_acc = part_ml = out  # not read
    sinks_arg = out if sinks is None else sinks  # (out: not read)

    grid = (num_seqs, num_q_tiles, num_kv_heads * num_kv_splits)
    _paged_attention_kernel[grid](
        out, part_acc, part_ml, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        sinks_arg, scale * _LOG2E, window or 0, (softcap or 0.0) * _LOG2E, num_heads,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        NUM_QUERIES_PER_KV=queries_per_kv,
        QPK_PAD=qpk_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=_BLOCK_N,
        NUM_SPLITS=num_kv_splits,
        DOT_IN_FP32=query.dtype == torch.bfloat16 and query.device.type != "cuda",
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
    )
    if num_kv_splits > 1:
        _merge_kv_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_ml, sinks_arg, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads,
            NUM_SPLITS=num_kv_splits,
            SPLITS_PAD=triton.next_power_of_2(num_kv_splits),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            HAS_SINKS=sinks is not None,
        )
    return out
