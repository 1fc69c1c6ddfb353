"""Triton rejection sampling: speculative decoding's verification walk, one program a request.

``kernels.rejection`` says what is computed; this file splits it where each tool is good.
torch turns the sampled rows' logits into their target distributions (``sampling_probs``: a
sort, prefix sums) and draws their noise (per row, a generator seeded by (seed, position),
salted) exactly as the torch verifier does. The kernel then walks each request's drafts in
order, stopping at the first rejection, so a request whose first draft fails reads one row:

- greedy rows: the draft is accepted while it is the row's argmax (lowest index on ties);
- sampled rows: the draft d is accepted while u < p(d) (the proposal is one-hot);

and at the row where the walk stops it writes the token drawn there: the argmax (greedy), or
the exponential race ``argmax(p / E)`` over p with the rejected draft removed (p itself at the
bonus row). The race divides with IEEE rounding (``div_rn``) and compares in fp32, as torch
does, over the same p, u and E: the tokens are the torch verifier's, bit for bit, which is
what the tests hold it to.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from actorlm.kernels.rejection import draft_noise, sampling_probs
from actorlm.sampling_params import GREEDY_TEMPERATURE

_MAX_BLOCK_V = 4096  # vocabulary chunk streamed per step
_NO_TOKEN = -1  # a "draft" no column matches: the bonus row removes nothing


@triton.jit
def _row_argmax(row_ptr, vocab_size, BLOCK_V: tl.constexpr):
    """The first index of a row's largest value, streamed in ``BLOCK_V`` chunks."""
    offs_v = tl.arange(0, BLOCK_V)
    best = tl.full([], float("-inf"), dtype=tl.float32)
    arg = tl.full([], 0, dtype=tl.int32)
    for v0 in range(0, vocab_size, BLOCK_V):
        cols = v0 + offs_v
        mask = cols < vocab_size
        x = tl.load(row_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        chunk_best = tl.max(x, axis=0)
        chunk_arg = tl.min(tl.where(mask & (x == chunk_best), cols, 2147483647), axis=0)
        better = chunk_best > best  # strict: an earlier chunk keeps ties
        arg = tl.where(better, chunk_arg, arg)
        best = tl.where(better, chunk_best, best)
    return arg


@triton.jit
def _race(probs_row_ptr, noise_row_ptr, removed, vocab_size, BLOCK_V: tl.constexpr):
    """argmax over the row of p / E, with p(removed) taken as 0 (the first index on ties)."""
    offs_v = tl.arange(0, BLOCK_V)
    best = tl.full([], -1.0, dtype=tl.float32)  # every real score is >= 0
    arg = tl.full([], 0, dtype=tl.int32)
    for v0 in range(0, vocab_size, BLOCK_V):
        cols = v0 + offs_v
        mask = cols < vocab_size
        p = tl.load(probs_row_ptr + cols, mask=mask, other=0.0)
        e = tl.load(noise_row_ptr + cols, mask=mask, other=1.0)
        p = tl.where(cols == removed, 0.0, p)
        score = tl.where(mask, tl.div_rn(p, e), -1.0)
        chunk_best = tl.max(score, axis=0)
        chunk_arg = tl.min(tl.where(score == chunk_best, cols, 2147483647), axis=0)
        better = chunk_best > best
        arg = tl.where(better, chunk_arg, arg)
        best = tl.where(better, chunk_best, best)
    return arg


@triton.jit
def _rejection_kernel(
    out_ptr,  # [B, max(k) + 1] int64, filled with -1
    logits_ptr,  # [R, V]: the greedy requests' rows are read
    probs_ptr,  # [S, V] f32: the sampled requests' rows' target distributions
    noise_ptr,  # [S, V] f32: their Exp(1) race noise
    uniform_ptr,  # [S] f32: their acceptance draws
    drafts_ptr,  # [R - B] int64: each request's drafts, concatenated
    num_drafts_ptr,  # [B] int32: k_b
    first_row_ptr,  # [B] int32: request b's row 0 in logits
    first_sampled_ptr,  # [B] int32: its row 0 in probs / noise / uniform; -1: a greedy request
    vocab_size,
    stride_logits,
    stride_probs,
    stride_noise,
    stride_out,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    k = tl.load(num_drafts_ptr + b)
    first_row = tl.load(first_row_ptr + b)
    first_draft = first_row - b  # each request before b has one row more than drafts
    first_sampled = tl.load(first_sampled_ptr + b)
    is_greedy = first_sampled < 0
    sampled_row0 = tl.maximum(first_sampled, 0)

    # Walk the drafts: num_accepted grows while each is accepted.
    num_accepted = tl.full([], 0, dtype=tl.int32)
    accepting = k > 0
    while accepting:
        draft = tl.load(drafts_ptr + first_draft + num_accepted).to(tl.int32)
        if is_greedy:
            row_ptr = logits_ptr + (first_row + num_accepted).to(tl.int64) * stride_logits
            accepted = _row_argmax(row_ptr, vocab_size, BLOCK_V) == draft
        else:
            row = (sampled_row0 + num_accepted).to(tl.int64)
            p_draft = tl.load(probs_ptr + row * stride_probs + draft)
            accepted = tl.load(uniform_ptr + row) < p_draft
        num_accepted += accepted.to(tl.int32)
        accepting = accepted & (num_accepted < k)

    # The token drawn where the walk stopped: at the rejected draft's row, or the bonus row.
    stop = num_accepted
    rejected = tl.where(stop < k, tl.load(drafts_ptr + first_draft + stop, mask=stop < k,
                                          other=0).to(tl.int32), -1)
    if is_greedy:
        row_ptr = logits_ptr + (first_row + stop).to(tl.int64) * stride_logits
        token = _row_argmax(row_ptr, vocab_size, BLOCK_V)
    else:
        row = (sampled_row0 + stop).to(tl.int64)
        token = _race(probs_ptr + row * stride_probs, noise_ptr + row * stride_noise, rejected,
                      vocab_size, BLOCK_V)

    offs_k = tl.arange(0, BLOCK_K)
    out_row = out_ptr + b.to(tl.int64) * stride_out
    accepted_drafts = tl.load(drafts_ptr + first_draft + offs_k, mask=offs_k < stop, other=0)
    tl.store(out_row + offs_k, accepted_drafts, mask=offs_k < stop)
    tl.store(out_row + stop, token.to(tl.int64))


def rejection_sample(logits: torch.Tensor, num_drafts: list[int], draft_token_ids: torch.Tensor,
                     temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
                     ) -> torch.Tensor:
    """``kernels.rejection.rejection_sample``'s contract and tokens: logits [R, V] (processed,
    R = sum(k_b + 1), request b's rows together); draft_token_ids [R - B] int64; temperature,
    top_k, top_p, min_p, seeds, positions [B]. Returns [B, max(k) + 1] int64, then -1."""
    assert logits.dim() == 2 and logits.stride(1) == 1, (logits.shape, logits.stride())
    assert logits.dtype in (torch.float32, torch.float16, torch.bfloat16), logits.dtype
    num_rows, vocab_size = logits.shape
    num_requests, dev = len(num_drafts), logits.device
    assert num_requests > 0 and min(num_drafts) >= 0, num_drafts
    assert num_rows == sum(num_drafts) + num_requests, (num_rows, num_drafts)
    assert draft_token_ids.shape == (num_rows - num_requests,), draft_token_ids.shape
    assert draft_token_ids.dtype == torch.int64, draft_token_ids.dtype
    for name, t in {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p,
                    "seeds": seeds, "positions": positions}.items():
        assert t.shape == (num_requests,), f"{name}: {tuple(t.shape)}, want ({num_requests},)"

    first_rows, sampled_rows, first_sampled = [], [], []
    row = 0
    for b, is_greedy in enumerate((temperature < GREEDY_TEMPERATURE).tolist()):
        first_rows.append(row)
        first_sampled.append(-1 if is_greedy else len(sampled_rows))
        if not is_greedy:
            sampled_rows += [(b, j) for j in range(num_drafts[b] + 1)]
        row += num_drafts[b] + 1
    probs, noise, uniform = _sampled_inputs(logits, sampled_rows, first_rows, temperature,
                                            top_k, top_p, min_p, seeds, positions)

    def column(values):
        return torch.tensor(values, dtype=torch.int32, device=dev)

    out = torch.full((num_requests, max(num_drafts) + 1), -1, dtype=torch.int64, device=dev)
    _rejection_kernel[(num_requests,)](
        out, logits, probs, noise, uniform, draft_token_ids.to(dev).contiguous(),
        column(num_drafts), column(first_rows), column(first_sampled),
        vocab_size, logits.stride(0), probs.stride(0), noise.stride(0), out.stride(0),
        BLOCK_V=min(triton.next_power_of_2(vocab_size), _MAX_BLOCK_V),
        BLOCK_K=triton.next_power_of_2(max(num_drafts) + 1),
    )
    return out


def _sampled_inputs(logits, sampled_rows, first_rows, temperature, top_k, top_p, min_p, seeds,
                    positions) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(probs [S, V], Exp(1) noise [S, V], u [S]) of the sampled rows, (request, j) each, as
    ``kernels.rejection`` computes them: the same distributions, the same per-row generator
    seeds, the same draws. S = 0: empty tensors the kernel never reads."""
    vocab_size, dev = logits.shape[1], logits.device
    if not sampled_rows:
        empty = torch.zeros(1, vocab_size, dtype=torch.float32, device=dev)
        return empty, empty, torch.zeros(1, dtype=torch.float32, device=dev)
    requests = torch.tensor([b for b, _ in sampled_rows], device=dev)
    rows = torch.tensor([first_rows[b] + j for b, j in sampled_rows], device=dev)
    offsets = torch.tensor([j for _, j in sampled_rows], device=dev)
    probs = sampling_probs(logits[rows], temperature[requests], top_k[requests],
                           top_p[requests], min_p[requests])
    uniform, noise = draft_noise(seeds[requests], positions[requests] + offsets, vocab_size,
                                 dev)
    return probs.contiguous(), noise.contiguous(), uniform.contiguous()
