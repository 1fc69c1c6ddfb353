"""sample (Triton, interpreted on the CPU): greedy, distributions, seeds.

The Triton and torch samplers use different noise, so they are compared exactly on greedy rows
and in distribution otherwise: a chi-square goodness-of-fit test over 12,000 draws (one launch,
one row per draw, every row with its own seed and position) against the distribution computed
here from the definitions, rejected at significance 0.001.
"""

from __future__ import annotations

import pytest
import torch

from actorlm.kernels.triton import sampling
from actorlm.kernels.cpu.sampler import sample as sample_ref
from actorlm.kernels.triton.sampling import sample

SIGNIFICANCE = 1e-3
NUM_DRAWS = 12_000

# A small vocabulary with well separated probabilities, in shuffled order, so no top-p or
# min-p boundary lies within float rounding of a threshold.
PROBS = torch.tensor([0.06, 0.3, 0.01, 0.15, 0.003, 0.08, 0.2, 0.02, 0.1, 0.007, 0.04, 0.03], dtype=torch.float64)
LOGITS = (PROBS.log() + 1.7).float()  # [V]; an offset the softmax must not care about


def _params(num_rows, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed_base=0):
    return dict(
        temperature=torch.full((num_rows,), temperature, dtype=torch.float32),
        top_k=torch.full((num_rows,), top_k, dtype=torch.int32),
        top_p=torch.full((num_rows,), top_p, dtype=torch.float32),
        min_p=torch.full((num_rows,), min_p, dtype=torch.float32),
        seeds=torch.arange(num_rows, dtype=torch.int64) * 1_000_003 + seed_base,
        positions=torch.arange(num_rows, dtype=torch.int64) % 97,
    )


def _call(fn, logits, p):
    return fn(logits, p["temperature"], p["top_k"], p["top_p"], p["min_p"], p["seeds"], p["positions"])


def _expected_distribution(logits, temperature, top_k, top_p, min_p):
    """The target distribution, straight from the definitions (a sort is fine in a test)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k > 0:
        keep[order[top_k:]] = False
    if top_p < 1.0:
        renormalised = probs * keep / (probs * keep).sum()
        mass_before = renormalised[order].cumsum(0) - renormalised[order]
        keep[order[mass_before >= top_p]] = False
    keep &= probs >= min_p * probs.max()
    kept = probs * keep
    return kept / kept.sum()


def _chi_square_p_value(counts, expected_probs):
    """Pearson's chi-square over the support; p = Q(df / 2, stat / 2), the regularised upper
    incomplete gamma function (exactly what scipy.stats.chi2.sf computes)."""
    support = expected_probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts.tolist()}"
    expected = expected_probs[support] * counts.sum()
    assert expected.min() >= 5, "too few draws per cell for the chi-square approximation"
    stat = ((counts[support].double() - expected) ** 2 / expected).sum()
    df = int(support.sum()) - 1
    assert df >= 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()


@pytest.mark.parametrize(
    "case",
    [
        dict(temperature=0.7),
        dict(temperature=1.6),
        dict(top_k=4),
        dict(top_p=0.7),
        dict(min_p=0.25),
        dict(temperature=1.3, top_k=6, top_p=0.8, min_p=0.3),  # top-p over the top-k set binds
        dict(temperature=1.3, top_k=6, top_p=0.9, min_p=0.5),  # min-p binds
    ],
    ids=["temperature-0.7", "temperature-1.6", "top-k", "top-p", "min-p", "top-k-then-top-p", "all-then-min-p"],
)
def test_draws_follow_the_expected_distribution(case):
    logits = LOGITS.expand(NUM_DRAWS, -1).contiguous()  # [N, V]: one draw per row, one launch
    p = _params(NUM_DRAWS, **case)
    tokens = _call(sample, logits, p)
    assert tokens.dtype == torch.int64 and tokens.shape == (NUM_DRAWS,)
    counts = torch.bincount(tokens, minlength=LOGITS.numel())
    expected = _expected_distribution(
        LOGITS, case.get("temperature", 1.0), case.get("top_k", 0), case.get("top_p", 1.0), case.get("min_p", 0.0)
    )
    p_value = _chi_square_p_value(counts, expected)
    assert p_value >= SIGNIFICANCE, f"p={p_value:.2e}, counts {counts.tolist()}, expected {expected.tolist()}"


def test_expected_distribution_helper_truncates_as_defined():
    # Guards the oracle itself: top-p 0.7 keeps 0.3, 0.2, 0.15, 0.1 (0.65 < 0.7 <= 0.75).
    kept = _expected_distribution(LOGITS, 1.0, 0, 0.7, 0.0) > 0
    assert kept.nonzero().flatten().tolist() == [1, 3, 6, 8]
    kept = _expected_distribution(LOGITS, 1.0, 0, 1.0, 0.25) > 0  # p >= 0.075
    assert kept.nonzero().flatten().tolist() == [1, 3, 5, 6, 8]
    # At T=1.3 the top-6 set, renormalised, reaches 0.8 at four tokens (the full distribution
    # would need five); min-p 0.3 keeps five, so top-p decides.
    kept = _expected_distribution(LOGITS, 1.3, 6, 0.8, 0.3) > 0
    assert kept.nonzero().flatten().tolist() == [1, 3, 6, 8]
    kept = _expected_distribution(LOGITS, 1.3, 6, 0.9, 0.5) > 0  # top-p keeps five, min-p three
    assert kept.nonzero().flatten().tolist() == [1, 3, 6]


def test_greedy_equals_argmax_with_lowest_index_on_ties():
    gen = torch.Generator().manual_seed(0)
    num_rows, vocab_size = 48, 300
    logits = torch.randn(num_rows, vocab_size, generator=gen)
    logits[0, [7, 200]] = 50.0  # tie: the lower index wins
    logits[1, :] = 3.0  # all tied
    logits[2, [299, 0]] = 50.0
    logits[3, :] = float("-inf")
    logits[3, 5] = 0.0
    p = _params(num_rows, temperature=0.0)
    p["temperature"][1::2] = 1e-6  # below the greedy threshold too
    tokens = _call(sample, logits, p)
    assert tokens[:3].tolist() == [7, 0, 0] and tokens[3].item() == 5
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert torch.equal(tokens, _call(sample_ref, logits, p))


def test_greedy_rows_mixed_with_sampled_rows():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 40, generator=gen)
    p = _params(64, temperature=1.0)
    p["temperature"][::3] = 0.0
    tokens = _call(sample, logits, p)
    greedy = p["temperature"] == 0.0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(dim=-1))
    assert not torch.equal(tokens[~greedy], logits[~greedy].argmax(dim=-1))  # sampled rows vary


def test_degenerate_truncations_reduce_to_argmax():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(30, 50, generator=gen)
    p = _params(30, temperature=1.0)
    p["top_k"][:10] = 1  # one candidate
    p["top_p"][10:20] = 1e-6  # the smallest head is the top token
    p["min_p"][20:] = 1.0  # only tokens as likely as the best
    assert torch.equal(_call(sample, logits, p), logits.argmax(dim=-1))


def test_top_k_at_or_beyond_vocab_size_is_off():
    logits = LOGITS.expand(NUM_DRAWS // 4, -1).contiguous()
    disabled = _call(sample, logits, _params(logits.shape[0], top_k=0))
    for top_k in (LOGITS.numel(), 1000):
        assert torch.equal(_call(sample, logits, _params(logits.shape[0], top_k=top_k)), disabled)


def test_seeded_rows_ignore_their_batch_neighbours():
    gen = torch.Generator().manual_seed(3)
    vocab_size, num_probes = 64, 16
    probe_logits = torch.randn(num_probes, vocab_size, generator=gen)
    probe = _params(num_probes, temperature=1.5, seed_base=12345)
    probe["top_k"][::2] = 20
    probe["top_p"][1::4] = 0.9
    probe["min_p"][2::4] = 0.05

    def batch_with_neighbours(num_rows, slots, neighbour_seed):
        g = torch.Generator().manual_seed(neighbour_seed)
        logits = torch.randn(num_rows, vocab_size, generator=g) * 3
        p = _params(num_rows, temperature=0.8, top_k=5, seed_base=neighbour_seed)
        p["temperature"][::5] = 0.0
        logits[slots] = probe_logits
        for name in p:
            p[name][slots] = probe[name]
        return logits, p

    alone = _call(sample, probe_logits, probe)
    # Different batch sizes change how rows are packed into programs, too.
    for num_rows, neighbour_seed in ((40, 1), (300, 2), (17, 3)):
        slots = torch.randperm(num_rows, generator=gen)[:num_probes]
        logits, p = batch_with_neighbours(num_rows, slots, neighbour_seed)
        assert torch.equal(_call(sample, logits, p)[slots], alone)

    # The draws do depend on the seed and on the position (otherwise the above proves nothing).
    reseeded = dict(probe, seeds=probe["seeds"] + 1)
    moved = dict(probe, positions=probe["positions"] + 1)
    assert not torch.equal(_call(sample, probe_logits, reseeded), alone)
    assert not torch.equal(_call(sample, probe_logits, moved), alone)


def test_chunked_vocabulary_matches_single_chunk(monkeypatch):
    # A large vocabulary is streamed in chunks, one row per program; force that path on a small
    # one. Noise depends only on (seed, position, token), so the draws must be identical.
    gen = torch.Generator().manual_seed(4)
    num_rows, vocab_size = 8, 40
    logits = torch.randn(num_rows, vocab_size, generator=gen) * 2
    logits[0, [3, 35]] = 20.0  # greedy tie across chunks
    p = _params(num_rows, temperature=1.2)
    p["temperature"][0] = 0.0
    p["top_k"][[1, 4]] = 7
    p["top_p"][[2, 4]] = 0.75
    p["min_p"][[3, 4]] = 0.1
    single = _call(sample, logits, p)
    monkeypatch.setattr(sampling, "_MAX_BLOCK_V", 16)
    chunked = _call(sample, logits, p)
    assert single[0].item() == 3
    assert torch.equal(chunked, single)
