"""The rejection sampler of speculative decoding, in torch on any device.

A request with k draft tokens has k + 1 rows of (processed) logits: row j scores the token
after its j-th draft (row 0 the token after its context, row k the bonus position). Its output
is the accepted prefix of the drafts plus one token drawn at the first rejected row — or at row
k when every draft is accepted — so a step yields 1 to k + 1 tokens per request.

- Greedy rows (temperature < ``GREEDY_TEMPERATURE``): a draft is accepted while it is the
  row's argmax; the token drawn is the argmax where it is not (or the bonus row's).
- Sampled rows (Leviathan et al., 2023; vLLM's ``rejection_sampler.py``): with p the row's
  target distribution (temperature, top-k, top-p, min-p; ``reference.sampling_probs_ref``) and
  q the proposer's, draft d is accepted when u < p(d) / q(d), u ~ U[0, 1); a rejected row draws
  from max(p - q, 0), renormalised; the bonus row from p. Prompt lookup proposes one token with
  certainty (q one-hot), so acceptance is u < p(d) and the recovered draw is p without d. The
  output then has exactly the target's distribution, whatever the drafts.

Each row's noise (its u and the exponential race of its draw) is a pure function of (seed,
output position), as in the sampler, so a seeded request's tokens do not depend on its batch
neighbours; its streams are salted apart from the plain sampler's.
"""

from __future__ import annotations

import torch

from actorlm.hashing import mix64, row_seed
from actorlm.sampling_params import GREEDY_TEMPERATURE

_SALT = 0x5BEC_DEC0DE  # keeps these draws apart from the plain sampler's at the same position


def rejection_sample(logits: torch.Tensor, num_drafts: list[int], draft_token_ids: torch.Tensor,
                     temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
                     ) -> torch.Tensor:
    """Verify each request's drafts. logits: [R, V] fp32, processed, R = sum(k_b + 1), request
    b's rows together in order; ``num_drafts``: k_b; draft_token_ids: [R - B] int64 (each
    request's drafts, concatenated); temperature, top_k, top_p, min_p, seeds, positions: [B]
    (``positions[b]``: the output index of request b's row 0). Returns [B, max(k) + 1] int64:
    each request's output tokens, then -1."""
    num_rows, vocab_size = logits.shape
    dev = logits.device
    counts = torch.tensor([k + 1 for k in num_drafts], device=dev)
    request_of_row = torch.repeat_interleave(torch.arange(len(num_drafts), device=dev), counts)
    first_row = torch.cumsum(counts, 0) - counts  # [B]
    offset = torch.arange(num_rows, device=dev) - first_row[request_of_row]  # j of each row
    is_bonus = offset == counts[request_of_row] - 1
    # each row's draft (the bonus rows have none: 0, never read)
    drafts = torch.zeros(num_rows, dtype=torch.int64, device=dev)
    drafts[~is_bonus] = draft_token_ids.to(dev)
    is_greedy = temperature[request_of_row] < GREEDY_TEMPERATURE
    choice = logits.argmax(dim=-1)  # greedy rows' token
    accepted = choice == drafts
    sampled = (~is_greedy).nonzero().flatten().tolist()
    if sampled:
        rows = torch.tensor(sampled, device=dev)
        b = request_of_row[rows]
        probs = sampling_probs(logits[rows], temperature[b], top_k[b], top_p[b], min_p[b])
        u, exp_noise = draft_noise(seeds[b], positions[b] + offset[rows], vocab_size,
                                   dev)  # [S], [S, V]
        row_drafts = drafts[rows]
        p_draft = probs.gather(1, row_drafts[:, None])[:, 0]
        accepted[rows] = u < p_draft
        # a rejected draft is drawn from p without it; the bonus row from p itself
        without = probs.scatter(1, row_drafts[:, None], 0.0)
        probs = torch.where(is_bonus[rows, None], probs, without)
        choice[rows] = (probs / exp_noise).argmax(dim=-1)
    accepted &= ~is_bonus
    out = torch.full((len(num_drafts), max(num_drafts) + 1), -1, dtype=torch.int64, device=dev)
    for b, (start, k) in enumerate(zip(first_row.tolist(), num_drafts)):
        rejected = (~accepted[start:start + k]).nonzero()
        a = int(rejected[0]) if len(rejected) else k
        out[b, :a] = drafts[start:start + a]
        out[b, a] = choice[start + a]
    return out


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                   top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[S, V] fp32, batched: each row's target distribution, as ``sampling_probs_ref`` says
    (temperature, then top-k, top-p on the renormalised head, min-p; the top token stays)."""
    scaled, keep = sampling_mask(logits, temperature, top_k, top_p, min_p)
    kept = torch.softmax(scaled, dim=-1) * keep
    return kept / kept.sum(-1, keepdim=True)


def sampling_mask(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                  top_p: torch.Tensor, min_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits / temperature [S, V] fp32, the tokens ``sampling_probs`` keeps [S, V] bool)."""
    vocab_size = logits.shape[1]
    scaled = logits.float() / temperature.float()[:, None]
    probs = torch.softmax(scaled, dim=-1)  # [S, V]
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab_size, device=logits.device)[None, :]
    k = torch.where((top_k > 0) & (top_k < vocab_size), top_k, vocab_size).long()
    keep = rank < k[:, None]  # [S, V] in descending order
    head = sorted_probs * keep
    head = head / head.sum(-1, keepdim=True)
    keep &= (head.cumsum(-1) - head < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    keep[:, 0] = True
    return scaled, torch.zeros_like(keep).scatter_(1, order, keep)


def draft_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int, device
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per verified row (its request's seed, its position): u ~ U[0, 1) and [V] Exp(1) draws,
    from a generator seeded by the row's seed alone, salted apart from the plain sampler's.
    Every verifier draws its noise here, so they agree token for token."""
    row_seeds = [mix64(row_seed(s, p) ^ _SALT) for s, p in zip(seeds.tolist(),
                                                                positions.tolist())]
    u = torch.empty(len(row_seeds), device=device)
    exp_noise = torch.empty(len(row_seeds), vocab_size, device=device)
    for i, seed in enumerate(row_seeds):
        gen = torch.Generator(device=device).manual_seed(seed & ((1 << 63) - 1))
        u[i] = torch.rand(1, generator=gen, device=device)[0]
        torch.rand(vocab_size, generator=gen, device=device, out=exp_noise[i])
    return u, exp_noise.log_().neg_()  # u = 0 gives +inf: that token loses the race
