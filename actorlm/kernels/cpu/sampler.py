"""The CPU's sampler, in torch: greedy, or temperature + top-k + top-p + min-p with seeded noise.

Batched over the step's rows, each kind of row (greedy, whole vocabulary, truncated) in one
pass. The noise of a row is a pure function of its (seed, position), so a seeded request draws
the same tokens whatever its batch neighbours. The Triton sampler draws from the same
distribution (``reference.sampling_probs_ref``) with other noise.
"""

from __future__ import annotations

import torch

from actorlm.hashing import row_seed
from actorlm.sampling_params import GREEDY_TEMPERATURE

# top-p without top-k first looks at this many most likely tokens (a topk is far cheaper than
# sorting the vocabulary) and sorts everything only when the nucleus does not fit.
_TOP_P_CANDIDATES = 1024


def sample(logits, temperature, top_k, top_p, min_p, seeds, positions) -> torch.Tensor:
    """One token per row: greedy, or temperature + top-k + top-p + min-p with seeded noise.

    logits: [B, V] float32; temperature, top_p, min_p: [B] f32; top_k: [B] int32 (<= 0: off);
    seeds, positions: [B] int64. Rows with temperature < 1e-5 take the argmax (lowest index on
    ties). Others: softmax(logits / T); keep the top_k most likely; then the smallest head of
    that (renormalised) distribution whose mass >= top_p; then drop tokens below
    min_p * max_prob; draw by an exponential race, argmax(p / E), whose Exp(1) noise comes from
    a generator seeded by (seed, position) alone, so a row never depends on its neighbours.
    Returns [B] int64.
    """
    num_rows, vocab_size = logits.shape
    is_sampled = (temperature >= GREEDY_TEMPERATURE).tolist()
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    greedy = [i for i, s in enumerate(is_sampled) if not s]
    if greedy:
        tokens[greedy] = _rows(logits, greedy).argmax(dim=-1)  # argmax returns the first maximum
    sampled = [i for i, s in enumerate(is_sampled) if s]
    if not sampled:
        return tokens
    # Whether a row truncates depends on its own parameters only, never on its neighbours.
    truncates = ((top_k[sampled] > 0) & (top_k[sampled] < vocab_size) | (top_p[sampled] < 1.0)).tolist()
    for is_truncated, sample in ((False, _sample_whole_vocab), (True, _sample_truncated)):
        rows = [i for i, t in zip(sampled, truncates) if t == is_truncated]
        if not rows:
            continue
        scaled = _rows(logits, rows).float() / temperature[rows, None].float()  # [S, V]
        k = top_k[rows].long()
        k = torch.where((k > 0) & (k < vocab_size), k, vocab_size)
        row_seeds = [row_seed(s, pos) for s, pos in zip(seeds[rows].tolist(), positions[rows].tolist())]
        tokens[rows] = sample(scaled, k, top_p[rows].float(), min_p[rows].float(), row_seeds)
    return tokens


def _rows(x, rows: list[int]):
    """x[rows] without the copy when rows is every row, in order (the common uniform batch)."""
    return x if rows == list(range(x.shape[0])) else x[rows]


def _uniform_noise(row_seed: int, n: int, device, out=None) -> torch.Tensor:
    """[n] U[0, 1) draws, a pure function of row_seed."""
    gen = torch.Generator(device=device).manual_seed(row_seed)
    return torch.rand(n, generator=gen, device=device, out=out)


def _sample_whole_vocab(scaled, top_k, top_p, min_p, row_seeds):
    """Rows with top-k and top-p off: race over all V tokens, noise indexed by token id.

    scaled: [S, V] logits / T. In log space argmax(p / E) is argmax(scaled - log E), so no
    softmax is needed; min-p's p < min_p * max_p is scaled < max + log(min_p).
    """
    drop = None
    if bool((min_p > 0).any()):
        top = scaled.max(dim=-1, keepdim=True).values  # [S, 1]; the top token always survives
        drop = scaled < top + min_p.log()[:, None]
    log_e = torch.empty_like(scaled)  # [S, V]
    for b, s in enumerate(row_seeds):
        _uniform_noise(s, scaled.shape[1], scaled.device, out=log_e[b])
    log_e.log_().neg_().log_()  # log(E), E = -log(u); u = 0 gives +inf: that token loses
    score = scaled - log_e
    if drop is not None:
        score.masked_fill_(drop, float("-inf"))
    return score.argmax(dim=-1)


def _sample_truncated(scaled, top_k, top_p, min_p, row_seeds):
    """Rows with top-k or top-p: the kept tokens are a prefix of the descending order."""
    probs = torch.softmax(scaled, dim=-1)  # [S, V]
    vocab_size = probs.shape[1]
    limited_k = top_k[top_k < vocab_size]
    num_candidates = int(limited_k.max()) if limited_k.numel() else 0
    if bool((top_k == vocab_size).any()):
        num_candidates = max(num_candidates, _TOP_P_CANDIDATES)
    if num_candidates < vocab_size:
        cand_probs, cand_ids = _top_candidates(probs, num_candidates)
        keep = _kept_prefix(cand_probs, probs, top_k, top_p, min_p)
        # A nucleus that may run past the candidates needs the full sort after all.
        if not bool((keep[:, -1] & (top_k > num_candidates)).any()):
            return _race_prefixes(cand_probs, cand_ids, keep, row_seeds)
    cand_probs, cand_ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep = _kept_prefix(cand_probs, probs, top_k, top_p, min_p)
    return _race_prefixes(cand_probs, cand_ids, keep, row_seeds)


def _top_candidates(probs, num):
    """The ``num`` most likely tokens, descending, ties by lower id (as a stable full sort)."""
    vals, ids = torch.topk(probs, num, dim=-1)  # [S, C]; topk orders ties arbitrarily
    ids, order = ids.sort(dim=-1)
    vals, order = vals.gather(1, order).sort(dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, order)


def _kept_prefix(cand_probs, probs, top_k, top_p, min_p):
    """[S, C] bool: which descending candidates survive top-k, then top-p, then min-p."""
    num_candidates = cand_probs.shape[1]
    rank = torch.arange(num_candidates, device=probs.device)
    in_top_k = rank[None, :] < top_k[:, None]  # [S, C]
    # Mass of the top-k tokens, to renormalise before top-p; with top-k off that is all of V.
    mass = torch.where(top_k <= num_candidates, (cand_probs * in_top_k).sum(-1), probs.sum(-1))
    head = cand_probs * in_top_k / mass[:, None]
    mass_before = head.cumsum(dim=-1) - head  # exclusive prefix sum
    in_top_p = (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    above_min_p = cand_probs >= min_p[:, None] * cand_probs[:, :1]
    keep = in_top_k & in_top_p & above_min_p
    keep[:, 0] = True  # the most likely token always survives
    return keep


def _race_prefixes(cand_probs, cand_ids, keep, row_seeds):
    """Exponential race over each row's kept prefix, noise indexed by rank."""
    num_kept = keep.sum(dim=-1).tolist()
    choice = []
    for b, (n, s) in enumerate(zip(num_kept, row_seeds)):
        exp_noise = _uniform_noise(s, n, cand_probs.device).log_().neg_()  # u = 0: inf, that token loses
        choice.append(int((cand_probs[b, :n] / exp_noise).argmax()))  # all zero: rank 0
    return cand_ids[torch.arange(len(choice)), torch.tensor(choice)]
