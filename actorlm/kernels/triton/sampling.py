"""Triton sampling: greedy, temperature, top-k, top-p and min-p in one launch, without a sort.

Each program owns ``BLOCK_R`` rows (one for a large vocabulary, many for a small one) and
streams the vocabulary in ``BLOCK_V`` chunks. Probabilities are kept relative to the most
likely token, ``q = exp((logit - max) / T)`` in (0, 1], so min-p is the threshold ``q >= min_p``
and no normaliser is needed. The top-k and top-p thresholds are found by bisection on the bit
pattern of ``q`` (for non-negative floats the bits order like the values): 30 masked counting
(top-k) or summing (top-p) passes land exactly on the k-th largest value or on the smallest
head whose mass reaches ``top_p``. Ties at a threshold are all kept. The draw is an
exponential race, ``argmax(q / E)`` over kept tokens, which picks token i with probability
proportional to ``q_i`` and needs no cumulative sum. ``E = -log(u)`` with ``u`` from Philox keyed
by the row's seed, with counter (token index, position): a pure function of (seed, position,
token), so a seeded row draws the same token whatever its batch neighbours.

The CPU sampler (``kernels/cpu/sampler.py``) draws from the same distribution
(``reference.sampling_probs_ref``) with a different noise source, so the two agree on greedy
rows and in distribution, not draw by draw.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actorlm.sampling_params import GREEDY_TEMPERATURE

_MAX_BLOCK_V = 4096  # vocabulary chunk streamed per step
# Elements of a [BLOCK_R, BLOCK_V] tile when several rows share a program: register-sized on a
# GPU; large on the CPU interpreter, whose cost is per operation rather than per element.
_ROWS_TILE_GPU = 2048
_ROWS_TILE_CPU = 65536
_ONE_BITS = 0x3F800000  # float32 1.0; q never exceeds it
_SEARCH_STEPS = 30  # ceil(log2(_ONE_BITS + 1)): bisection over [0, 1.0] bit patterns


@triton.jit
def _relative_probs(logits_row_ptr, cols, mask, row_max, inv_temp_log2e):
    """q = exp((x - max) / T) in [0, 1] for one chunk; 0 outside ``mask``."""
    x = tl.load(logits_row_ptr + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
    q = tl.exp2((x - row_max[:, None]) * inv_temp_log2e[:, None])
    return tl.where(mask, q, 0.0)


@triton.jit
def _sample_kernel(
    out_ptr,  # [B] int64
    logits_ptr,  # [B, V]
    temperature_ptr,  # [B] f32
    top_k_ptr,  # [B] int32
    top_p_ptr,  # [B] f32
    min_p_ptr,  # [B] f32
    seeds_ptr,  # [B] int64
    positions_ptr,  # [B] int64
    num_rows,
    vocab_size,
    stride_row,
    BLOCK_R: tl.constexpr,
    BLOCK_V: tl.constexpr,
    ONE_BITS: tl.constexpr,
    SEARCH_STEPS: tl.constexpr,
    GREEDY_TEMPERATURE: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    row_mask = rows < num_rows
    row_ptrs = logits_ptr + rows.to(tl.int64)[:, None] * stride_row  # [BLOCK_R, 1]
    temperature = tl.load(temperature_ptr + rows, mask=row_mask, other=1.0)
    is_greedy = temperature < GREEDY_TEMPERATURE
    is_sampled = row_mask & ~is_greedy
    inv_temp_log2e = tl.where(is_greedy, 1.0, 1.0 / tl.maximum(temperature, GREEDY_TEMPERATURE)) * 1.4426950408889634
    top_k = tl.load(top_k_ptr + rows, mask=row_mask, other=0)
    top_p = tl.load(top_p_ptr + rows, mask=row_mask, other=1.0)
    min_p = tl.load(min_p_ptr + rows, mask=row_mask, other=0.0)
    offs_v = tl.arange(0, BLOCK_V)

    # Pass 1: max logit and its lowest index (the greedy answer).
    row_max = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    argmax = tl.zeros([BLOCK_R], dtype=tl.int32)
    for v0 in range(0, vocab_size, BLOCK_V):
        cols = v0 + offs_v
        mask = row_mask[:, None] & (cols < vocab_size)[None, :]  # [BLOCK_R, BLOCK_V]
        x = tl.load(row_ptrs + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        chunk_max = tl.max(x, axis=1)
        chunk_arg = tl.min(tl.where(x == chunk_max[:, None], cols[None, :], 2147483647), axis=1)
        better = chunk_max > row_max  # strict: an earlier chunk keeps ties
        argmax = tl.where(better, chunk_arg, argmax)
        row_max = tl.where(better, chunk_max, row_max)

    # A row of -inf logits (or a row past the batch) keeps a finite max: its q are all 0.
    row_max = tl.where(row_max > float("-inf"), row_max, 0.0)

    # Keep q >= threshold. min-p is a ratio to the most likely token, whose q is exactly 1.
    threshold = tl.where(is_sampled & (min_p > 0.0), min_p, 0.0)

    # top-k: the largest t with count(q >= t) >= k is the k-th largest q.
    use_top_k = is_sampled & (top_k > 0) & (top_k < vocab_size)
    if tl.max(use_top_k.to(tl.int32), axis=0) > 0:
        lo = tl.zeros([BLOCK_R], dtype=tl.int32)  # count(q >= 0.0) = V >= k
        hi = tl.full([BLOCK_R], ONE_BITS + 1, dtype=tl.int32)  # count(q > 1.0) = 0 < k
        for _ in range(SEARCH_STEPS):
            mid = lo + (hi - lo) // 2
            t = mid.to(tl.float32, bitcast=True)
            count = tl.zeros([BLOCK_R], dtype=tl.int32)
            for v0 in range(0, vocab_size, BLOCK_V):
                cols = v0 + offs_v
                mask = row_mask[:, None] & (cols < vocab_size)[None, :]
                q = _relative_probs(row_ptrs, cols, mask, row_max, inv_temp_log2e)
                count += tl.sum((mask & (q >= t[:, None])).to(tl.int32), axis=1)
            ok = count >= top_k
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        top_k_threshold = lo.to(tl.float32, bitcast=True)
    else:
        top_k_threshold = tl.zeros([BLOCK_R], dtype=tl.float32)
    top_k_threshold = tl.where(use_top_k, top_k_threshold, 0.0)

    # top-p over the renormalised top-k set: the largest t whose head {q >= t} holds at least
    # top_p of the set's mass. The head is never empty: q = 1 is always in it.
    use_top_p = is_sampled & (top_p < 1.0)
    if tl.max(use_top_p.to(tl.int32), axis=0) > 0:
        kept_mass = tl.zeros([BLOCK_R], dtype=tl.float32)
        for v0 in range(0, vocab_size, BLOCK_V):
            cols = v0 + offs_v
            mask = row_mask[:, None] & (cols < vocab_size)[None, :]
            q = _relative_probs(row_ptrs, cols, mask, row_max, inv_temp_log2e)
            kept_mass += tl.sum(tl.where(q >= top_k_threshold[:, None], q, 0.0), axis=1)
        target = top_p * kept_mass
        lo = tl.zeros([BLOCK_R], dtype=tl.int32)
        hi = tl.full([BLOCK_R], ONE_BITS + 1, dtype=tl.int32)
        for _ in range(SEARCH_STEPS):
            mid = lo + (hi - lo) // 2
            t = tl.maximum(mid.to(tl.float32, bitcast=True), top_k_threshold)
            mass = tl.zeros([BLOCK_R], dtype=tl.float32)
            for v0 in range(0, vocab_size, BLOCK_V):
                cols = v0 + offs_v
                mask = row_mask[:, None] & (cols < vocab_size)[None, :]
                q = _relative_probs(row_ptrs, cols, mask, row_max, inv_temp_log2e)
                mass += tl.sum(tl.where(q >= t[:, None], q, 0.0), axis=1)
            ok = (mass >= target) & (mass > 0.0)
            lo = tl.where(ok, mid, lo)
            hi = tl.where(ok, hi, mid)
        top_p_threshold = lo.to(tl.float32, bitcast=True)
    else:
        top_p_threshold = tl.zeros([BLOCK_R], dtype=tl.float32)
    top_p_threshold = tl.where(use_top_p, top_p_threshold, 0.0)
    threshold = tl.maximum(threshold, tl.maximum(top_k_threshold, top_p_threshold))

    # Exponential race over the kept tokens: argmax q / E, E ~ Exp(1) from Philox.
    seed = tl.load(seeds_ptr + rows, mask=row_mask, other=0)[:, None]  # [BLOCK_R, 1] key
    position = tl.load(positions_ptr + rows, mask=row_mask, other=0)[:, None]
    pos_lo = (position & 0xFFFFFFFF).to(tl.uint32)
    pos_hi = ((position >> 32) & 0xFFFFFFFF).to(tl.uint32)
    best_score = tl.full([BLOCK_R], -1.0, dtype=tl.float32)
    choice = argmax
    for v0 in range(0, vocab_size, BLOCK_V):
        cols = v0 + offs_v
        mask = row_mask[:, None] & (cols < vocab_size)[None, :]
        q = _relative_probs(row_ptrs, cols, mask, row_max, inv_temp_log2e)
        keep = mask & (q >= threshold[:, None]) & (q > 0.0)
        counter = cols[None, :].to(tl.uint32) + tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.uint32)
        zeros = tl.zeros([BLOCK_R, BLOCK_V], dtype=tl.uint32)
        bits, _, _, _ = tl.philox(seed, counter, pos_lo + zeros, pos_hi + zeros, zeros)
        u = tl.uint_to_uniform_float(bits)  # [0, 1)
        noise = -tl.log(tl.maximum(u, 1.0e-30))  # Exp(1), > 0
        score = tl.where(keep, q / noise, -1.0)
        chunk_best = tl.max(score, axis=1)
        chunk_arg = tl.min(tl.where(score == chunk_best[:, None], cols[None, :], 2147483647), axis=1)
        better = chunk_best > best_score
        choice = tl.where(better, chunk_arg, choice)
        best_score = tl.where(better, chunk_best, best_score)

    tokens = tl.where(is_greedy, argmax, choice)
    tl.store(out_ptr + rows, tokens.to(tl.int64), mask=row_mask)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """One token per row. logits: [B, V]; temperature, top_p, min_p: [B] f32; top_k: [B] int32
    (<= 0 disables); seeds, positions: [B] int64. Returns [B] int64.

    temperature < 1e-5 takes the argmax (lowest index on ties); otherwise softmax(logits / T),
    then top-k, then top-p on the renormalised top-k set, then min-p, then a seeded draw.
    """
    assert logits.dim() == 2 and logits.stride(1) == 1, (logits.shape, logits.stride())
    assert logits.dtype in (torch.float32, torch.float16, torch.bfloat16), logits.dtype
    num_rows, vocab_size = logits.shape
    expected = {
        "temperature": (temperature, torch.float32),
        "top_k": (top_k, torch.int32),
        "top_p": (top_p, torch.float32),
        "min_p": (min_p, torch.float32),
        "seeds": (seeds, torch.int64),
        "positions": (positions, torch.int64),
    }
    for name, (t, dtype) in expected.items():
        assert t.shape == (num_rows,) and t.dtype == dtype, f"{name}: {tuple(t.shape)} {t.dtype}, want {dtype}"
        assert t.is_contiguous() and t.device == logits.device, name
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows == 0:
        return out
    assert vocab_size > 0

    block_v = min(triton.next_power_of_2(vocab_size), _MAX_BLOCK_V)
    if block_v >= vocab_size:
        # The whole row fits in one chunk: pack several rows per program.
        rows_tile = _ROWS_TILE_GPU if logits.device.type == "cuda" else _ROWS_TILE_CPU
        block_r = min(triton.next_power_of_2(num_rows), max(1, rows_tile // block_v))
    else:
        block_r = 1
    _sample_kernel[(triton.cdiv(num_rows, block_r),)](
        out, logits, temperature, top_k, top_p, min_p, seeds, positions,
        num_rows, vocab_size, logits.stride(0),
        BLOCK_R=block_r,
        BLOCK_V=block_v,
        ONE_BITS=_ONE_BITS,
        SEARCH_STEPS=_SEARCH_STEPS,
        GREEDY_TEMPERATURE=GREEDY_TEMPERATURE,
        num_warps=4 if block_r * block_v <= 1024 else 8,
    )
    return out
