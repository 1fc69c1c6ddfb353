"""From one step's raw logits to tokens: logit processing, penalties, logprobs, sampling.

vLLM's order, batched over the step (one tensor operation per kind of processing, only over
the rows that ask for it):
1. logprobs come from the *raw* logits (what the model said, before any processing), or, by
   ``--logprobs-mode`` (vLLM's), from the processed ones: the distribution the token is drawn
   from (after step 3, then a random row's temperature, top-k, top-p and min-p, the tokens they
   leave out at -inf); ``*_logits`` modes report the logits themselves;
2. allowed_token_ids, bad_words, min_tokens (EOS and stop tokens banned) and logit_bias;
3. repetition penalty (prompt and output tokens), frequency and presence penalties (output);
4. greedy rows take the argmax; the others go to the backend's sampling kernel (temperature,
   top-k, top-p, min-p, seeded). Both backends share steps 1-3, so they agree on them.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from actorlm.kernels.rejection import sampling_mask
from actorlm.messages import PositionLogprobs
from actorlm.sampling_params import SamplingParams


class SamplingState(Protocol):
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed: int
    bad_words_token_ids: list[list[int]]


def sample(logits: torch.Tensor, states: Sequence[SamplingState], backend,
           eos_token_ids: frozenset[int], logprobs_mode: str = "raw_logprobs"
           ) -> tuple[list[int], list[PositionLogprobs | None]]:
    """Tokens for each row of ``logits`` ([N, V] fp32, raw; processed in place), and their
    logprobs where asked (``logprobs_mode``: from which logits, and what is reported)."""
    wanted = [s.sampling_params.logprobs for s in states]
    source = _LogprobSource(logprobs_mode, any(k is not None for k in wanted), logits)
    logits = apply_processors(logits, states, eos_token_ids)
    source.processed(logits, states)
    token_list = _draw(logits, states, backend).tolist()
    if source.logits is None:
        return token_list, [None] * len(states)
    rows = [i for i, k in enumerate(wanted) if k is not None]
    found = token_logprobs(source.logits[rows], [token_list[i] for i in rows],
                           [wanted[i] for i in rows], source.as_logits)
    logprobs: list[PositionLogprobs | None] = [None] * len(states)
    for i, entry in zip(rows, found):
        logprobs[i] = entry
    return token_list, logprobs


def verify(logits: torch.Tensor, states: Sequence[SamplingState], drafts: Sequence[list[int]],
           backend, eos_token_ids: frozenset[int], logprobs_mode: str = "raw_logprobs"
           ) -> tuple[list[list[int]], list[list[PositionLogprobs] | None]]:
    """Speculative decoding: each request's output tokens (its accepted drafts, then the token
    drawn after them) and their logprobs where asked. logits: [R, V] fp32, raw (processed in
    place), request i's ``len(drafts[i]) + 1`` rows together in order; row j is processed as if
    its first j drafts were already output (penalties, bad words, min_tokens see them). A
    request without drafts is sampled as ``sample`` would."""
    rows = [_Drafted(s, d[:j]) for s, d in zip(states, drafts) for j in range(len(d) + 1)]
    wanted = [s.sampling_params.logprobs for s in states]
    source = _LogprobSource(logprobs_mode, any(k is not None for k in wanted), logits)
    logits = apply_processors(logits, rows, eos_token_ids)
    source.processed(logits, rows)
    starts = [0]
    for d in drafts:
        starts.append(starts[-1] + len(d) + 1)
    outputs: list[list[int]] = [[] for _ in states]
    plain = [i for i, d in enumerate(drafts) if not d]
    if plain:
        for i, token in zip(plain, _draw(logits[[starts[i] for i in plain]],
                                         [states[i] for i in plain], backend).tolist()):
            outputs[i] = [token]
    if spec := [i for i, d in enumerate(drafts) if d]:
        spec_rows = [r for i in spec for r in range(starts[i], starts[i + 1])]
        dev = logits.device
        params = [states[i].sampling_params for i in spec]
        verified = backend.rejection_sample(
            logits[spec_rows], [len(drafts[i]) for i in spec],
            torch.tensor([t for i in spec for t in drafts[i]], dtype=torch.int64, device=dev),
            *_columns(params, [states[i] for i in spec], dev))
        for i, tokens in zip(spec, verified.tolist()):
            outputs[i] = tokens[:tokens.index(-1)] if -1 in tokens else tokens
    logprobs: list[list[PositionLogprobs] | None] = [None] * len(states)
    if source.logits is not None:
        asked = [i for i, k in enumerate(wanted) if k is not None]
        found = iter(token_logprobs(
            source.logits[[starts[i] + j for i in asked for j in range(len(outputs[i]))]],
            [t for i in asked for t in outputs[i]],
            [wanted[i] for i in asked for _ in outputs[i]], source.as_logits))
        for i in asked:
            logprobs[i] = [next(found) for _ in outputs[i]]
    return outputs, logprobs


class _LogprobSource:
    """The logits a step's logprobs come from, by ``--logprobs-mode``: a copy of the raw ones
    (``raw_*``), or of the processed ones as the sampler draws from them (``processed_*``),
    kept only where some row asks; ``as_logits``: report the values themselves."""

    def __init__(self, mode: str, asked: bool, raw: torch.Tensor):
        self.mode, self.as_logits = mode, mode.endswith("_logits")
        self.logits = raw.clone() if asked and mode.startswith("raw") else None
        self._asked = asked

    def processed(self, logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
        """Keep ``logits`` (steps 2 and 3 done) with each random row's temperature and its
        top-k, top-p and min-p cuts, as its token is drawn (greedy rows: as they are)."""
        if not (self._asked and self.mode.startswith("processed")):
            return
        self.logits = logits.clone()
        params = [s.sampling_params for s in states]
        random = [i for i, p in enumerate(params) if not p.is_greedy]
        if random:
            columns = _columns([params[i] for i in random], [states[i] for i in random],
                               logits.device)[:4]
            scaled, keep = sampling_mask(self.logits[random], *columns)
            self.logits[random] = scaled.masked_fill(~keep, float("-inf"))


class _Drafted:
    """A request's sampling state as if ``drafts`` followed its tokens (a verified row's)."""

    __slots__ = ("_state", "_drafts", "num_prompt_tokens", "sampling_params", "seed",
                 "bad_words_token_ids")

    def __init__(self, state: SamplingState, drafts: list[int]):
        self._state, self._drafts = state, drafts
        self.num_prompt_tokens = state.num_prompt_tokens
        self.sampling_params = state.sampling_params
        self.seed = state.seed
        self.bad_words_token_ids = state.bad_words_token_ids

    @property
    def token_ids(self) -> list[int]:
        return self._state.token_ids + self._drafts if self._drafts else self._state.token_ids


def _draw(logits: torch.Tensor, states: Sequence[SamplingState], backend) -> torch.Tensor:
    """[N] tokens from processed logits: the argmax where every row is greedy, else the
    backend's seeded sampler (noise keyed by each row's output position)."""
    params = [s.sampling_params for s in states]
    if all(p.is_greedy for p in params):
        return backend.argmax(logits)  # skips building per-row parameter tensors
    return backend.sample(logits, *_columns(params, states, logits.device))


_INT32_MAX = 2**31 - 1


def _columns(params: Sequence[SamplingParams], states: Sequence[SamplingState], device):
    """The per-row parameter tensors of the sampling kernels: temperature, top_k, top_p,
    min_p, seeds, positions (the index of the output token each row draws)."""
    def column(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)

    # (a top_k at or past the vocabulary keeps every token: capped, any 64-bit count that
    # SamplingParams takes fits the kernels' int32 and means the same)
    return (column([p.temperature for p in params], torch.float32),
            column([min(p.top_k, _INT32_MAX) for p in params], torch.int32),
            column([p.top_p for p in params], torch.float32),
            column([p.min_p for p in params], torch.float32),
            column([s.seed for s in states], torch.int64),
            column([len(s.token_ids) - s.num_prompt_tokens for s in states], torch.int64))


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int],
                   num_top: Sequence[int], as_logits: bool = False) -> list[PositionLogprobs]:
    """For each row: the logprob and rank of ``token_ids[i]`` plus the row's top ``num_top[i]``
    (``as_logits``: the logits in place of logprobs, ranked alike)."""
    logprobs = logits.float() if as_logits else torch.log_softmax(logits.float(), dim=-1)
    chosen = torch.tensor(token_ids, device=logits.device)
    chosen_lp = logprobs.gather(1, chosen[:, None])  # [N, 1]
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    k = max(num_top)
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], chosen[:, None][:, :0])
    out = []
    for i, n in enumerate(num_top):
        out.append(PositionLogprobs([token_ids[i]] + top_ids[i, :n].tolist(),
                                    [float(chosen_lp[i, 0])] + top_lp[i, :n].tolist(),
                                    int(ranks[i])))
    return out


def apply_processors(logits: torch.Tensor, states: Sequence[SamplingState],
                     eos_token_ids: frozenset[int]) -> torch.Tensor:
    """Steps 2 and 3 above, in place on ``logits`` [N, V]; returns it."""
    num_rows, vocab = logits.shape
    banned_rows, banned_ids, bias_rows, bias_ids, bias_values = [], [], [], [], []
    allowed = []  # (row, allowed ids)
    for row, state in enumerate(states):
        p, output = state.sampling_params, state.token_ids[state.num_prompt_tokens:]
        if p.allowed_token_ids is not None:
            allowed.append((row, p.allowed_token_ids))
        banned = set()
        if len(output) < p.min_tokens:
            banned |= set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids)
        for word in state.bad_words_token_ids:
            # a bad word's last token is banned when the output already ends with the rest
            if len(word) == 1 or output[len(output) - len(word) + 1:] == word[:-1]:
                banned.add(word[-1])
        banned_rows += [row] * len(banned)
        banned_ids += banned
        for token_id, bias in (p.logit_bias or {}).items():
            bias_rows.append(row)
            bias_ids.append(token_id)
            bias_values.append(bias)
    dev = logits.device
    if allowed:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        for row, ids in allowed:
            keep[row, torch.tensor(ids, device=dev)] = True
        rows = torch.tensor([r for r, _ in allowed], device=dev)
        logits[rows] = logits[rows].masked_fill(~keep[rows], float("-inf"))
    if bias_rows:
        logits.index_put_((torch.tensor(bias_rows, device=dev), torch.tensor(bias_ids, device=dev)),
                          torch.tensor(bias_values, dtype=logits.dtype, device=dev),
                          accumulate=True)
    if banned_rows:
        logits[torch.tensor(banned_rows, device=dev), torch.tensor(banned_ids, device=dev)] = \
            float("-inf")
    _apply_penalties(logits, states)
    return logits


def _apply_penalties(logits: torch.Tensor, states: Sequence[SamplingState]) -> None:
    rows = [i for i, s in enumerate(states) if _has_penalty(s.sampling_params)]
    if not rows:
        return
    vocab, dev = logits.shape[1], logits.device
    chosen = [states[i] for i in rows]
    # counts of each token in the output, and which tokens the prompt holds: [R, V]
    counts = _token_counts([s.token_ids[s.num_prompt_tokens:] for s in chosen], vocab, dev)
    in_prompt = _token_counts([s.token_ids[:s.num_prompt_tokens] for s in chosen], vocab, dev) > 0
    params = [s.sampling_params for s in chosen]

    def column(name):
        return torch.tensor([getattr(p, name) for p in params], dtype=logits.dtype,
                            device=dev)[:, None]

    sub = logits[rows]  # [R, V]
    repetition = column("repetition_penalty")
    seen = in_prompt | (counts > 0)
    penalised = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(seen, penalised, sub)
    sub = sub - column("frequency_penalty") * counts - column("presence_penalty") * (counts > 0)
    logits[rows] = sub


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _token_counts(sequences: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[R, V] float counts; an extra padding column absorbs the ragged ends."""
    width = max(1, max(len(s) for s in sequences))
    ids = torch.tensor([s + [vocab] * (width - len(s)) for s in sequences], device=device)
    counts = torch.zeros(len(sequences), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]
