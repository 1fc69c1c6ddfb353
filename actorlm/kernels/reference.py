"""Plain-torch twins of the kernels: the engine's CPU path and the oracle for the Triton ones.

Each ``foo_ref`` has exactly the signature of the Triton launcher ``foo`` and states the
semantics the kernel must reproduce. Performance still matters here, because on a CPU these
functions *are* the engine: attention is batched over requests (no per-request loop per layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Seeds, positions and token ids are mixed with a 32-bit integer hash (Chris Wellons'
# "lowbias32"), done in int64 so every product fits without overflow. A Triton kernel can
# reproduce it bit for bit with uint32 arithmetic.
_MASK32 = 0xFFFFFFFF
_GREEDY_TEMPERATURE = 1e-5


def write_kv_ref(key, value, k_cache, v_cache, slot_mapping) -> None:
    """Scatter new K/V into the paged cache, in place; a negative slot skips its token.

    key, value: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    slot_mapping: [T] int64, slot = block_id * block_size + offset.
    """
    num_kv_heads, head_dim = k_cache.shape[-2:]
    assert key.shape == value.shape and key.shape[1:] == (num_kv_heads, head_dim), (key.shape, k_cache.shape)
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "the paged cache must be contiguous"
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_blocks * block_size, Hkv, D]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    slots = slot_mapping.to(torch.int64)
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


def paged_attention_ref(
    query,
    k_cache,
    v_cache,
    block_tables,
    query_start_loc,
    seq_lens,
    scale: float,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Causal varlen attention over the paged cache, for a mixed batch of prefills and decodes.

    query: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (Hq % Hkv == 0);
    block_tables: [B, max_blocks] int32; query_start_loc: [B + 1] int32; seq_lens: [B] int32.
    Request b's queries are the last q_len_b positions of its seq_lens[b]-token context, whose
    K/V are already in the cache; the query at position p sees kv positions 0..p.
    Returns [T, Hq, D] in query's dtype; scores, softmax and sums are fp32.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert k_cache.shape[-1] == head_dim, (k_cache.shape, query.shape)
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # [B]
    if max_query_len is None:
        max_query_len = int(q_lens.max()) if q_lens.numel() else 0
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max()) if seq_lens.numel() else 0
    out = torch.empty_like(query)
    if num_tokens == 0:
        return out
    if max_query_len == 1 and num_tokens == seq_lens.shape[0]:
        # Pure decode step: one query per request, no padding needed.
        out.copy_(_attend_decodes(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len))
        return out

    # Mixed step: decodes take the cheap path; prefill chunks are padded to their longest.
    is_decode = q_lens == 1
    decode_ids = is_decode.nonzero().flatten()
    if decode_ids.numel():
        rows = query_start_loc[decode_ids].long()
        d_seq_lens = seq_lens[decode_ids]
        out[rows] = _attend_decodes(
            query[rows], k_cache, v_cache, block_tables[decode_ids], d_seq_lens, scale, int(d_seq_lens.max())
        )
    prefill_ids = (~is_decode & (q_lens > 0)).nonzero().flatten()
    if prefill_ids.numel():
        p_q_lens = q_lens[prefill_ids]
        p_seq_lens = seq_lens[prefill_ids]
        _attend_prefills(
            query, out, k_cache, v_cache, block_tables[prefill_ids], query_start_loc[prefill_ids],
            p_q_lens, p_seq_lens, scale, int(p_q_lens.max()), int(p_seq_lens.max()),
        )  # fmt: skip
    return out


def _gather_kv(k_cache, v_cache, block_tables, max_seq_len):
    """Each request's context as a dense [B, Hkv, S, D] tensor, S = blocks needed * block_size."""
    block_size = k_cache.shape[1]
    num_blocks = max(1, -(-max_seq_len // block_size))
    table = block_tables[:, :num_blocks].long()  # [B, nb]
    # k_cache[table]: [B, nb, block_size, Hkv, D] -> [B, S, Hkv, D] -> [B, Hkv, S, D]
    k = k_cache[table].flatten(1, 2).transpose(1, 2)
    v = v_cache[table].flatten(1, 2).transpose(1, 2)
    return k, v


def _sdpa(q, k, v, mask, scale):
    """q: [B, Hq, Lq, D]; k, v: [B, Hkv, S, D]; mask: [B, 1, Lq, S] bool -> [B, Hq, Lq, D]."""
    out_dtype = q.dtype
    if q.dtype != torch.float32:
        # The contract is fp32 accumulation; the CPU SDPA kernels do not promise it for bf16.
        q, k, v = q.float(), k.float(), v.float()
    # The GQA group shares one K/V head; SDPA broadcasts it (checked on CPU with a mask).
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return o.to(out_dtype)


def _attend_decodes(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len):
    """query: [B, Hq, D], one token per request at position seq_len - 1 -> [B, Hq, D]."""
    k, v = _gather_kv(k_cache, v_cache, block_tables, max_seq_len)
    kv_pos = torch.arange(k.shape[2], device=query.device)
    # The last token of a request sees its whole context and nothing past it.
    mask = (kv_pos[None, :] < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, S]
    return _sdpa(query[:, :, None, :], k, v, mask, scale)[:, :, 0, :]


def _attend_prefills(query, out, k_cache, v_cache, block_tables, starts, q_lens, seq_lens, scale, max_q, max_s):
    """Writes attention for requests with q_len > 1 into ``out`` (rows starts[b]..+q_lens[b])."""
    device = query.device
    offsets = torch.arange(max_q, device=device)  # [Lq]
    is_real = offsets[None, :] < q_lens[:, None]  # [B, Lq]
    # Padded rows read a real row (any will do) so the gather stays in bounds.
    rows = (starts.long()[:, None] + offsets[None, :]).clamp_(max=query.shape[0] - 1)  # [B, Lq]
    q = query[rows].transpose(1, 2)  # [B, Hq, Lq, D]
    k, v = _gather_kv(k_cache, v_cache, block_tables, max_s)
    q_pos = (seq_lens - q_lens)[:, None] + offsets[None, :]  # [B, Lq] absolute positions
    kv_pos = torch.arange(k.shape[2], device=device)  # [S]
    # A padded row's q_pos is >= seq_len, so it sees the whole context: never an empty
    # softmax, hence no NaN, and its output is dropped below.
    mask = (kv_pos[None, None, :] <= q_pos[:, :, None]) & (kv_pos[None, None, :] < seq_lens[:, None, None])
    o = _sdpa(q, k, v, mask[:, None], scale).transpose(1, 2)  # [B, Lq, Hq, D]
    out[rows[is_real]] = o[is_real]


def sample_ref(logits, temperature, top_k, top_p, min_p, seeds, positions) -> torch.Tensor:
    """One token per row: greedy, or temperature + top-k + top-p + min-p with seeded noise.

    logits: [B, V] float32; temperature, top_p, min_p: [B] f32; top_k: [B] int32 (<= 0: off);
    seeds, positions: [B] int64. Rows with temperature < 1e-5 take the argmax (lowest index on
    ties). Others: softmax(logits / T); keep the top_k most likely; then the smallest head of
    that (renormalised) distribution whose mass >= top_p; then drop tokens below
    min_p * max_prob; draw by an exponential race, argmax(p / E), where E for token i is a pure
    function of (seed, position, i) so a seeded row never depends on its batch neighbours.
    Returns [B] int64.
    """
    num_rows, vocab_size = logits.shape
    tokens = logits.argmax(dim=-1)  # [B]; argmax returns the first maximum
    sampled = (temperature >= _GREEDY_TEMPERATURE).nonzero().flatten()
    if sampled.numel() == 0:
        return tokens
    probs = torch.softmax(logits[sampled].float() / temperature[sampled, None].float(), dim=-1)  # [S, V]
    k = top_k[sampled].long()
    p = top_p[sampled].float()
    k = torch.where(k > 0, k.clamp(max=vocab_size), torch.full_like(k, vocab_size))
    num_candidates = int(k.max())
    if num_candidates == vocab_size and bool((p >= 1.0).all()):
        cand_probs, cand_ids = probs, None  # no truncation: race over the whole vocabulary
    elif num_candidates < vocab_size:
        cand_probs, cand_ids = torch.topk(probs, num_candidates, dim=-1)  # sorted, descending
    else:
        cand_probs, cand_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep = _candidate_mask(cand_probs, cand_ids is not None, k, p, min_p[sampled].float())
    ids = cand_ids if cand_ids is not None else torch.arange(vocab_size, device=logits.device).expand_as(probs)
    noise = _exponential_noise(seeds[sampled], positions[sampled], ids)  # [S, C]
    score = cand_probs.masked_fill(~keep, 0.0) / noise
    choice = score.argmax(dim=-1, keepdim=True)  # [S, 1]
    tokens[sampled] = ids.gather(1, choice).flatten()
    return tokens


def _candidate_mask(cand_probs, is_sorted, top_k, top_p, min_p):
    """Which candidates survive top-k, top-p and min-p; the most likely one always does.

    cand_probs: [S, C], descending when ``is_sorted`` (otherwise the whole vocabulary with
    top-k and top-p off); top_k: [S] int64 already clamped to [1, V].
    """
    max_prob = cand_probs.max(dim=-1, keepdim=True).values  # [S, 1]
    keep = cand_probs >= min_p[:, None] * max_prob  # min-p: a ratio, so renormalising cannot change it
    if is_sorted:
        rank = torch.arange(cand_probs.shape[1], device=cand_probs.device)
        in_top_k = rank[None, :] < top_k[:, None]  # [S, C]
        head = cand_probs * in_top_k
        head = head / head.sum(dim=-1, keepdim=True)  # renormalised after top-k
        mass_before = head.cumsum(dim=-1) - head  # exclusive prefix sum
        in_top_p = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        keep &= in_top_k & in_top_p
        keep[:, 0] = True
    else:
        keep |= cand_probs == max_prob
    return keep


def _mix32(x):
    """lowbias32 on int64 tensors holding uint32 values; all products stay below 2**63."""
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def _exponential_noise(seeds, positions, token_ids):
    """Exp(1) noise: [S] seeds, [S] positions, [S, C] token ids -> [S, C] float32 in (0, ~17]."""
    seeds = seeds.long()
    row = _mix32(seeds & _MASK32)
    row = _mix32(row ^ ((seeds >> 32) & _MASK32))
    row = _mix32(row ^ (positions.long() & _MASK32))  # [S]
    h = _mix32(row[:, None] ^ token_ids)  # [S, C]
    h = _mix32(h ^ 0x9E3779B9)  # a second round: neighbouring ids must look unrelated
    # 24 high bits -> uniform in (0, 1), never 0 or 1, so -log(u) is finite and positive.
    u = ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))
    return -torch.log(u)
