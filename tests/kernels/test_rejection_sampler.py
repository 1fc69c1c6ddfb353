"""rejection_sample and sampling_probs (``kernels/rejection.py``): the verifier of speculative
decoding, judged by the oracle ``reference.sampling_probs_ref``.

Speculative decoding is only worth having if it changes nothing but speed: greedy requests must
return exactly what plain greedy decoding would, and sampled requests must draw their tokens
from exactly the target distribution, whatever the drafts. So ``sampling_probs`` is held to the
float64 oracle, greedy verification is checked token by token, and the sampled path is held to
the oracle by a chi-square test over the joint law of the first two tokens of many seeded
requests (with a control showing the test rejects a plausible wrong sampler).
"""

from __future__ import annotations

import pytest
import torch

from actorlm.kernels.reference import sampling_probs_ref
from actorlm.kernels.rejection import rejection_sample, sampling_probs
from sampling_checks import assert_clear_of_thresholds

SIGNIFICANCE = 0.01


def request_params(num_requests, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed_base=0):
    """The per-request tensors ``rejection_sample`` takes: the same for every request but its
    seed; every request's row 0 at output position 0."""
    return dict(
        temperature=torch.full((num_requests,), temperature, dtype=torch.float32),
        top_k=torch.full((num_requests,), top_k, dtype=torch.int32),
        top_p=torch.full((num_requests,), top_p, dtype=torch.float32),
        min_p=torch.full((num_requests,), min_p, dtype=torch.float32),
        seeds=torch.arange(num_requests, dtype=torch.int64) + seed_base,
        positions=torch.zeros(num_requests, dtype=torch.int64),
    )


def verify(logits, num_drafts, drafts, params):
    p = params
    return rejection_sample(logits, num_drafts, torch.tensor(drafts, dtype=torch.int64),
                            p["temperature"], p["top_k"], p["top_p"], p["min_p"], p["seeds"],
                            p["positions"])


# ---------------------------------------------------------------------------- sampling_probs

# (temperature, top_k, top_p, min_p); top_k 0 / >= V, top_p 1.0 and min_p 0 are "off"
PROB_SETTINGS = [
    (1.0, 0, 1.0, 0.0),  # all off: the softmax
    (0.6, 0, 1.0, 0.0),
    (1.7, 5, 1.0, 0.0),
    (1.0, 0, 0.8, 0.0),
    (1.0, 0, 1.0, 0.1),
    (0.8, 12, 0.9, 0.02),
    (1.3, 37, 0.95, 0.0),  # top-k == V: off
    (1.0, 100, 1.0, 0.05),  # top-k > V: off
    (1.0, 1, 1.0, 0.0),  # one candidate
    (1.0, 0, 0.0, 0.0),  # top-p 0: the top token alone
    (2.0, 20, 0.5, 0.3),
]


def test_sampling_probs_matches_the_oracle():
    """fp32 against float64, V = 37 (not a power of two), 6 random rows per setting; the rows
    are clear of the top-p / min-p thresholds by more than fp32 rounding, so the supports must
    agree exactly and the probabilities within 1e-6."""
    vocab_size, rows_per_setting = 37, 6
    gen = torch.Generator().manual_seed(0)
    num_rows = rows_per_setting * len(PROB_SETTINGS)
    logits = torch.randn(num_rows, vocab_size, generator=gen) * 2.5  # [S, V]
    columns = list(zip(*PROB_SETTINGS))
    params = dict(
        temperature=torch.tensor(columns[0], dtype=torch.float32),
        top_k=torch.tensor(columns[1], dtype=torch.int32),
        top_p=torch.tensor(columns[2], dtype=torch.float32),
        min_p=torch.tensor(columns[3], dtype=torch.float32),
    )
    params = {name: t.repeat_interleave(rows_per_setting) for name, t in params.items()}
    assert_clear_of_thresholds(logits, params)

    got = sampling_probs(logits, params["temperature"], params["top_k"], params["top_p"],
                         params["min_p"])
    expected = sampling_probs_ref(logits, params["temperature"], params["top_k"],
                                  params["top_p"], params["min_p"])
    assert got.dtype == torch.float32 and got.shape == (num_rows, vocab_size)
    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=0)
    # the truncations did bite (the rows are not all plain softmaxes)
    num_kept = (expected > 0).sum(-1).view(len(PROB_SETTINGS), rows_per_setting)
    assert (num_kept[0] == vocab_size).all() and (num_kept[8:10] == 1).all()
    assert (num_kept[[2, 3, 4, 5, 10]] < vocab_size).all()


# ------------------------------------------------------------------------------------ greedy

# One request per entry: its rows' argmaxes (k + 1 of them), its k drafts, the output expected.
GREEDY_REQUESTS = [
    ([4, 7, 2], [4, 7], [4, 7, 2]),  # all accepted: + the bonus row's argmax
    ([9], [], [9]),  # k = 0: the argmax of its one row
    ([1, 5, 6, 3], [1, 0, 6], [1, 5]),  # mismatch at 1; the match after it is not taken
    ([3, 8], [2], [3]),  # mismatch at 0
    ([0, 0, 0, 10], [0, 0, 0], [0, 0, 0, 10]),  # the longest k, all accepted
    ([6, 2, 4], [6, 3], [6, 2]),  # mismatch at the last draft
]


def greedy_batch(vocab_size=11, seed=0):
    """(logits [R, V], num_drafts, drafts) of ``GREEDY_REQUESTS``: random rows whose argmax is
    raised well clear of the rest."""
    gen = torch.Generator().manual_seed(seed)
    argmaxes = [a for row_argmaxes, _, _ in GREEDY_REQUESTS for a in row_argmaxes]
    logits = torch.randn(len(argmaxes), vocab_size, generator=gen)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    num_drafts = [len(drafts) for _, drafts, _ in GREEDY_REQUESTS]
    drafts = [d for _, request_drafts, _ in GREEDY_REQUESTS for d in request_drafts]
    return logits, num_drafts, drafts


def expected_greedy_outputs():
    width = max(len(drafts) for _, drafts, _ in GREEDY_REQUESTS) + 1
    return torch.tensor([out + [-1] * (width - len(out)) for _, _, out in GREEDY_REQUESTS])


@pytest.mark.parametrize("temperature", [0.0, 1e-6])  # 1e-6: below the greedy threshold too
def test_greedy_accepts_drafts_while_they_are_the_argmax(temperature):
    logits, num_drafts, drafts = greedy_batch()
    params = request_params(len(num_drafts), temperature=temperature)
    out = verify(logits, num_drafts, drafts, params)
    assert out.dtype == torch.int64
    assert torch.equal(out, expected_greedy_outputs())


def test_greedy_requests_ignore_sampled_neighbours():
    """Greedy requests interleaved with sampled ones (whose rows take the other path) return
    the same outputs; the sampled requests' outputs are well formed: an accepted prefix of
    their drafts, then one token, then -1."""
    logits, num_drafts, drafts = greedy_batch()
    gen = torch.Generator().manual_seed(1)
    vocab_size = logits.shape[1]
    sampled_k = [3, 0, 2, 3, 1, 3]
    rows, all_k, all_drafts, temperature = [], [], [], []
    row, draft = 0, 0
    for (greedy_k, k) in zip(num_drafts, sampled_k):
        rows.append(logits[row:row + greedy_k + 1])
        all_k.append(greedy_k)
        all_drafts += drafts[draft:draft + greedy_k]
        temperature.append(0.0)
        row, draft = row + greedy_k + 1, draft + greedy_k
        rows.append(torch.randn(k + 1, vocab_size, generator=gen))
        all_k.append(k)
        all_drafts += torch.randint(0, vocab_size, (k,), generator=gen).tolist()
        temperature.append(1.0)
    params = request_params(len(all_k), seed_base=100)
    params["temperature"] = torch.tensor(temperature)
    out = verify(torch.cat(rows), all_k, all_drafts, params)

    width = max(all_k) + 1
    assert out.shape == (len(all_k), width)
    expected = expected_greedy_outputs()
    assert torch.equal(out[0::2, :expected.shape[1]], expected)
    assert (out[0::2, expected.shape[1]:] == -1).all()
    start = 0
    for b, k in enumerate(all_k):
        length = int((out[b] >= 0).sum())
        assert 1 <= length <= k + 1 and (out[b, length:] == -1).all()
        assert out[b, :length - 1].tolist() == all_drafts[start:start + length - 1]
        assert 0 <= out[b, length - 1] < vocab_size
        start += k


# ------------------------------------------------------------------------------ distribution

VOCAB_SIZE, NUM_DRAWS, PREV0 = 8, 20_000, 3


def markov_chain():
    """L [V, V]: row ``prev`` holds the target model's logits of the token after ``prev``."""
    return torch.randn(VOCAB_SIZE, VOCAB_SIZE, generator=torch.Generator().manual_seed(7)) * 1.5


def transition_probs(chain, temperature, top_p):
    """P [V, V] float64: P[prev, t], the oracle's distribution of the token after ``prev``."""
    params = request_params(VOCAB_SIZE, temperature=temperature, top_p=top_p)
    assert_clear_of_thresholds(chain, params)  # fp32 and float64 agree on every support
    return sampling_probs_ref(chain, params["temperature"], params["top_k"], params["top_p"],
                              params["min_p"])


def proposer_drafts(probs):
    """A proposer often but not always right: d0 the most likely token after ``PREV0``, d1 the
    second most likely after d0."""
    d0 = int(probs[PREV0].argmax())
    d1 = int(probs[d0].argsort(descending=True)[1])
    return d0, d1


def chi_square_p_value(counts, expected_probs):
    """Pearson's chi-square of ``counts`` against ``expected_probs`` (same shape) over the cells
    the oracle can reach (none may be drawn outside them), the cells expected fewer than 5
    times merged into one; p = Q(df / 2, stat / 2), the regularised upper incomplete gamma
    function, which is what scipy.stats.chi2.sf computes (scipy is not a dependency)."""
    counts, expected_probs = counts.flatten().double(), expected_probs.flatten()
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "drew pairs the oracle cannot"
    observed, expected = counts[support], expected_probs[support] * counts.sum()
    small = expected < 5
    if small.any():
        observed = torch.cat([observed[~small], observed[small].sum()[None]])
        expected = torch.cat([expected[~small], expected[small].sum()[None]])
        assert expected[-1] >= 5, "the merged cell is still too small: draw more"
    stat = ((observed - expected) ** 2 / expected).sum()
    df = observed.numel() - 1
    assert df >= 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()


def joint_counts(t0, t1):
    """[V, V]: how often each pair (t0, t1) was drawn."""
    return torch.bincount(t0 * VOCAB_SIZE + t1, minlength=VOCAB_SIZE**2).view(VOCAB_SIZE, -1)


def expected_joint(probs):
    """[V, V]: P(t0 | PREV0) * P(t1 | t0)."""
    return probs[PREV0][:, None] * probs


def first_two_tokens(out, probs, gen):
    """(t0, t1) of each output row: its first two tokens, or, where it has one, that token and
    one drawn after it from the plain target distribution (as the next step would)."""
    t0 = out[:, 0]
    tail = torch.multinomial(probs[t0], 1, generator=gen)[:, 0]
    t1 = torch.where(out[:, 1] >= 0, out[:, 1], tail)
    return t0, t1


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (1.0, 0.9)])
def test_sampled_outputs_follow_the_target_distribution(temperature, top_p):
    """N requests, each with its own seed, verify the same k = 2 drafts in one call; the first
    two tokens of their outputs follow the chain's joint law. The drafts are accepted and
    rejected in about the share the target gives them, so both paths are exercised."""
    chain = markov_chain()
    probs = transition_probs(chain, temperature, top_p)
    d0, d1 = proposer_drafts(probs)
    logits = chain[[PREV0, d0, d1]].repeat(NUM_DRAWS, 1)  # [3N, V]: rows after prev0, d0, d1
    params = request_params(NUM_DRAWS, temperature=temperature, top_p=top_p)
    out = verify(logits, [2] * NUM_DRAWS, [d0, d1] * NUM_DRAWS, params)
    assert out.shape == (NUM_DRAWS, 3)

    num_tokens = (out >= 0).sum(-1)
    assert ((out >= 0) == (torch.arange(3) < num_tokens[:, None])).all()  # then only -1
    accepted0 = num_tokens >= 2
    assert (out[accepted0, 0] == d0).all() and (out[~accepted0, 0] != d0).all()
    accepted1 = num_tokens == 3
    assert (out[accepted1, 1] == d1).all() and (out[accepted0 & ~accepted1, 1] != d1).all()
    # acceptance rates: p(d0 | prev0), and p(d1 | d0) among those that got that far (5 sigma)
    for accepted, among, p in ((accepted0, torch.ones_like(accepted0), probs[PREV0, d0]),
                               (accepted1, accepted0, probs[d0, d1])):
        num = int(among.sum())
        rate = accepted[among].double().mean()
        assert 0.05 < p < 0.95
        assert abs(rate - p) < 5 * (p * (1 - p) / num) ** 0.5, (rate, p)

    t0, t1 = first_two_tokens(out, probs, torch.Generator().manual_seed(11))
    p_value = chi_square_p_value(joint_counts(t0, t1), expected_joint(probs))
    assert p_value > SIGNIFICANCE, p_value


def naive_resampler(probs, d0, d1, gen):
    """A plausible wrong verifier: accepts as the right one does, but on a rejection redraws
    from p itself instead of p without the draft (so the draft is over-represented)."""
    def redraw(rows):  # one token per entry of ``rows`` from P[row]
        return torch.multinomial(probs[rows], 1, generator=gen)[:, 0]

    prev = torch.full((NUM_DRAWS,), PREV0)
    accepted0 = torch.rand(NUM_DRAWS, generator=gen, dtype=torch.float64) < probs[PREV0, d0]
    t0 = torch.where(accepted0, d0, redraw(prev))
    accepted1 = torch.rand(NUM_DRAWS, generator=gen, dtype=torch.float64) < probs[d0, d1]
    t1 = torch.where(accepted0, torch.where(accepted1, d1, redraw(torch.full_like(prev, d0))),
                     redraw(t0))
    return t0, t1


@pytest.mark.parametrize("wrong", ["always-accept", "redraw-with-the-draft"])
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_the_distribution_test_rejects_wrong_samplers(wrong, top_p):
    """The chi-square above has the power to see a wrong verifier at this many draws."""
    probs = transition_probs(markov_chain(), 1.0, top_p)
    d0, d1 = proposer_drafts(probs)
    if wrong == "always-accept":
        t0, t1 = torch.full((NUM_DRAWS,), d0), torch.full((NUM_DRAWS,), d1)
    else:
        t0, t1 = naive_resampler(probs, d0, d1, torch.Generator().manual_seed(5))
    assert chi_square_p_value(joint_counts(t0, t1), expected_joint(probs)) < SIGNIFICANCE


def test_a_seeded_request_ignores_its_batch_neighbours():
    """Each row's noise depends on (seed, position) alone: a request verified alone or among
    others returns the same tokens; moved to another position it does not (always)."""
    chain = markov_chain()
    gen = torch.Generator().manual_seed(2)
    num_probes = 64
    probe_logits = chain[[PREV0, 0, 1]].repeat(num_probes, 1)
    probe = request_params(num_probes, temperature=0.9, top_p=0.95, seed_base=1000)
    alone = verify(probe_logits, [2] * num_probes, [0, 1] * num_probes, probe)

    # the probes between neighbours with k = 1
    neighbour_logits = torch.randn(2 * num_probes, VOCAB_SIZE, generator=gen)
    logits = torch.cat([probe_logits.view(num_probes, 3, -1),
                        neighbour_logits.view(num_probes, 2, -1)], dim=1).view(-1, VOCAB_SIZE)
    neighbours = request_params(num_probes, temperature=1.0, seed_base=5000)
    params = {name: torch.stack([probe[name], neighbours[name]], 1).flatten()
              for name in probe}
    mixed = verify(logits, [2, 1] * num_probes, [0, 1, 4] * num_probes, params)
    assert torch.equal(mixed[0::2], alone)

    moved = dict(probe, positions=probe["positions"] + 1)
    assert not torch.equal(verify(probe_logits, [2] * num_probes, [0, 1] * num_probes, moved),
                           alone)
