"""The checks both samplers (Triton's, the CPU's) are held to, by ``reference.sampling_probs_ref``.

Samplers with different noise agree with the oracle in distribution, not draw by draw: a
chi-square goodness-of-fit test over ``NUM_DRAWS`` draws (one call, one row per draw, every row
with its own seed and position) against the oracle's distribution, rejected at significance
``SIGNIFICANCE``. No draw ever lies outside the oracle's support, greedy rows take its argmax,
and a seeded row draws the same token whatever its batch neighbours.
"""

from __future__ import annotations

import torch

from actorlm.kernels.reference import sampling_probs_ref
from tolerance import sum_error

SIGNIFICANCE = 1e-3
NUM_DRAWS = 12_000

# A small vocabulary with well separated probabilities, in shuffled order, so no top-p or
# min-p boundary lies within float rounding of a threshold (``assert_clear_of_thresholds``).
PROBS = torch.tensor([0.06, 0.3, 0.01, 0.15, 0.003, 0.08, 0.2, 0.02, 0.1, 0.007, 0.04, 0.03],
                     dtype=torch.float64)
LOGITS = (PROBS.log() + 1.7).float()  # [V]; an offset the softmax must not care about

# sampling parameters of the distribution tests, by id
CASES = {
    "temperature-0.7": dict(temperature=0.7),
    "temperature-1.6": dict(temperature=1.6),
    "top-k": dict(top_k=4),
    "top-p": dict(top_p=0.7),
    "min-p": dict(min_p=0.25),
    "top-k-then-top-p": dict(temperature=1.3, top_k=6, top_p=0.8, min_p=0.3),  # top-p binds
    "all-then-min-p": dict(temperature=1.3, top_k=6, top_p=0.9, min_p=0.5),  # min-p binds
}

def sampling_params(num_rows, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed_base=0):
    """The per-row tensors a sampler takes, the same for every row but seed and position."""
    return dict(
        temperature=torch.full((num_rows,), temperature, dtype=torch.float32),
        top_k=torch.full((num_rows,), top_k, dtype=torch.int32),
        top_p=torch.full((num_rows,), top_p, dtype=torch.float32),
        min_p=torch.full((num_rows,), min_p, dtype=torch.float32),
        seeds=torch.arange(num_rows, dtype=torch.int64) * 1_000_003 + seed_base,
        positions=torch.arange(num_rows, dtype=torch.int64) % 97,
    )


def call(sample, logits, params):
    return sample(logits, params["temperature"], params["top_k"], params["top_p"],
                  params["min_p"], params["seeds"], params["positions"])


def oracle_probs(logits, params, top_p_shift=0.0, min_p_shift=0.0):
    """[B, V] float64: ``sampling_probs_ref`` of each row, the thresholds that are on (top-p
    below 1, min-p above 0) moved by the shifts if asked."""
    top_p, min_p = params["top_p"].double(), params["min_p"].double()
    return sampling_probs_ref(logits, params["temperature"], params["top_k"],
                              torch.where(top_p < 1.0, top_p + top_p_shift, top_p),
                              torch.where(min_p > 0.0, min_p + min_p_shift, min_p))


def assert_clear_of_thresholds(logits, params):
    """The test data asks nothing of a sampler's rounding: each row's support stays the same
    with top-p and min-p moved either way by what an fp32 softmax and its prefix sums over V
    terms can be off by (a normaliser's and a running sum's bound, mass 1)."""
    margin = 2 * sum_error(logits.shape[-1], 1.0, torch.float32)
    fewest = oracle_probs(logits, params, -margin, margin) > 0
    most = oracle_probs(logits, params, margin, -margin) > 0
    assert torch.equal(fewest, most), "a row lies within rounding of a threshold: pick others"


def assert_in_support(tokens, logits, params):
    """Every row's token is one the oracle can draw (the rows clear of its thresholds)."""
    assert_clear_of_thresholds(logits, params)
    support = oracle_probs(logits, params) > 0  # [B, V]
    rows = torch.arange(tokens.shape[0])
    outside = ~support[rows, tokens]
    assert not outside.any(), f"rows {outside.nonzero().flatten().tolist()} drew masked tokens"


def truncation_case(num_rows=512, vocab_size=64):
    """(logits [B, V], params): random rows under each truncation alone and all at once, with
    per-row values, one row where only the top token survives (top-p 0)."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(num_rows, vocab_size, generator=gen) * 2
    params = sampling_params(num_rows)
    params["seeds"] = torch.randint(0, 2**62, (num_rows,), generator=gen)
    quarter = num_rows // 4
    params["top_k"][:quarter] = 5
    params["top_p"][quarter:2 * quarter] = 0.6
    params["min_p"][2 * quarter:3 * quarter] = 0.3
    rest = num_rows - 3 * quarter
    params["top_k"][3 * quarter:] = torch.randint(0, 10, (rest,), generator=gen, dtype=torch.int32)
    params["top_p"][3 * quarter:] = torch.rand(rest, generator=gen)
    params["min_p"][3 * quarter:] = torch.rand(rest, generator=gen) * 0.5
    params["top_p"][-1] = 0.0
    return logits, params


def chi_square_p_value(counts, expected_probs):
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


def assert_draws_follow_the_oracle(sample, case):
    """``NUM_DRAWS`` draws of ``sample`` from ``LOGITS`` with the parameters ``case`` pass the
    chi-square test against ``sampling_probs_ref``."""
    logits = LOGITS.expand(NUM_DRAWS, -1).contiguous()  # [N, V]: one draw per row, one call
    params = sampling_params(NUM_DRAWS, **case)
    tokens = call(sample, logits, params)
    assert tokens.dtype == torch.int64 and tokens.shape == (NUM_DRAWS,)
    counts = torch.bincount(tokens, minlength=LOGITS.numel())
    first = {name: t[:1] for name, t in params.items()}  # every row's distribution
    assert_clear_of_thresholds(LOGITS[None], first)
    expected = oracle_probs(LOGITS[None], first)[0]
    p_value = chi_square_p_value(counts, expected)
    assert p_value >= SIGNIFICANCE, \
        f"p={p_value:.2e}, counts {counts.tolist()}, expected {expected.tolist()}"


def greedy_case(num_rows=48, vocab_size=300):
    """(logits, params): greedy rows (temperature 0, or below the threshold) with ties."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(num_rows, vocab_size, generator=gen)
    logits[0, [7, 200]] = 50.0  # tie: the lower index wins
    logits[1, :] = 3.0  # all tied
    logits[2, [vocab_size - 1, 0]] = 50.0
    logits[3, :] = float("-inf")
    logits[3, 5] = 0.0
    params = sampling_params(num_rows, temperature=0.0)
    params["temperature"][1::2] = 1e-6  # below the greedy threshold too
    return logits, params


def assert_greedy_is_the_oracles_argmax(sample):
    logits, params = greedy_case()
    tokens = call(sample, logits, params)
    assert tokens.dtype == torch.int64
    assert tokens[:4].tolist() == [7, 0, 0, 5]
    assert torch.equal(tokens, oracle_probs(logits, params).argmax(dim=-1))  # all its mass there


def assert_seeded_rows_ignore_their_batch_neighbours(sample):
    """Probe rows (greedy neighbours, truncated and whole-vocabulary rows around them) draw the
    same tokens alone and at any slots of batches of any size; reseeded or moved, they don't."""
    gen = torch.Generator().manual_seed(3)
    vocab_size, num_probes = 64, 16
    probe_logits = torch.randn(num_probes, vocab_size, generator=gen)
    probe = sampling_params(num_probes, temperature=1.5, seed_base=12345)
    probe["top_k"][::2] = 20
    probe["top_p"][1::4] = 0.9
    probe["min_p"][2::4] = 0.05

    def batch_with_neighbours(num_rows, slots, neighbour_seed):
        g = torch.Generator().manual_seed(neighbour_seed)
        logits = torch.randn(num_rows, vocab_size, generator=g) * 3
        params = sampling_params(num_rows, temperature=0.8, top_k=5, seed_base=neighbour_seed)
        params["temperature"][::5] = 0.0
        logits[slots] = probe_logits
        for name in params:
            params[name][slots] = probe[name]
        return logits, params

    alone = call(sample, probe_logits, probe)
    # Different batch sizes change how rows are grouped and packed into programs, too.
    for num_rows, neighbour_seed in ((40, 1), (300, 2), (17, 3)):
        slots = torch.randperm(num_rows, generator=gen)[:num_probes]
        logits, params = batch_with_neighbours(num_rows, slots, neighbour_seed)
        assert torch.equal(call(sample, logits, params)[slots], alone)

    # The draws do depend on the seed and on the position (otherwise the above proves nothing).
    reseeded = dict(probe, seeds=probe["seeds"] + 1)
    moved = dict(probe, positions=probe["positions"] + 1)
    assert not torch.equal(call(sample, probe_logits, reseeded), alone)
    assert not torch.equal(call(sample, probe_logits, moved), alone)
