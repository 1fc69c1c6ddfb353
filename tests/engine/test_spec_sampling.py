"""Speculative decoding keeps the sampled distribution: through the whole engine, the first
tokens of many seeded samples with drafts cannot be told from those without.

A tiny random Llama at temperature 1 spreads its next token over hundreds of ids. One prompt
is sampled ``NUM_DRAWS`` times (``n``, each child its own seed) with ``MAX_TOKENS`` tokens,
without speculation and with it. The drafts come from the run without speculation (each the
most frequent next token after the same output there): plausible, right about one time in
six, so the engine accepts some drafts and rejects others; whatever it proposes, the output's
law must be the target's. The first token is the plain sampler's in both runs; the
next ones come from verification (accepted drafts, recovered tokens, the bonus draw).

The two samples are compared by a chi-square test of homogeneity over their first tokens,
each sample binned by the longest prefix that is frequent in the two together (so every cell
expects at least 5 of each). Controls show that the test can fail: a verifier that accepts
every draft, and the two settings' runs without speculation against each other.
"""

from __future__ import annotations

import collections

import pytest
import torch
from engine_helpers import assert_idle_and_nothing_leaked

import actorlm.models.parts
from actorlm import SamplingParams
from actorlm.kernels import rejection
from actorlm.kernels.backend import KernelBackend
from actorlm.llm import LLM
from actorlm.models.ngram_proposer import NgramProposer

NUM_DRAWS = 20_000  # per run
MAX_TOKENS = 4  # after the first token, a verification of 2 drafts (it yields up to 3)
NUM_SPECULATIVE_TOKENS = 3  # (the scheduler cuts the drafts to what max_tokens leaves)
PROMPT = [5, 17, 42, 99, 7]
SIGNIFICANCE = 0.01
MIN_POOLED = 10  # a cell's count in both samples together: >= 5 expected in each (equal sizes)
ENGINE_FLAGS = dict(dtype="float32", max_num_seqs=2048)

# (temperature, top_p) -> the first seed of its run without speculation; the run with it
# starts SPEC_SEED_OFFSET later, so no two runs share a seed (the samples are independent)
SETTINGS = {(1.0, 1.0): 0, (1.0, 0.9): 100_000}
SPEC_SEED_OFFSET = 1_000_000


def draw(llm, temperature, top_p, seed) -> list[tuple[int, ...]]:
    """``NUM_DRAWS`` samples of ``PROMPT``'s first ``MAX_TOKENS`` tokens, seeds seed, seed+1…"""
    params = SamplingParams(n=NUM_DRAWS, seed=seed, temperature=temperature, top_p=top_p,
                            max_tokens=MAX_TOKENS, ignore_eos=True)
    [output] = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    samples = [tuple(c.token_ids) for c in output.outputs]
    assert len(samples) == NUM_DRAWS and all(len(s) == MAX_TOKENS for s in samples)
    return samples


@pytest.fixture(scope="module")
def draws_without_speculation(tiny_llama_dir):
    """setting -> its samples without speculation, drawn once for the module."""
    llm = LLM(str(tiny_llama_dir), **ENGINE_FLAGS)
    drawn = {}

    def draws(setting):
        if setting not in drawn:
            drawn[setting] = draw(llm, *setting, seed=SETTINGS[setting])
        return drawn[setting]

    yield draws
    try:
        assert_idle_and_nothing_leaked(llm)
    finally:
        llm.shutdown()


class _EmpiricalProposer(NgramProposer):
    """Drafts each next token as the most frequent one after the same output so far in
    ``samples`` (after an output never seen there: the most frequent successor of its last
    token; after a token never seen: the most frequent token of all)."""

    def __init__(self, k, samples):  # (its batch and forget are prompt lookup's)
        self.k = k
        after_prefix, after_token = collections.Counter(), collections.Counter()
        for s in samples:
            for i in range(len(s) - 1):
                after_prefix[s[:i + 1], s[i + 1]] += 1
                after_token[s[i], s[i + 1]] += 1
        self.next_of = {}  # an output prefix, or a token -> its most frequent successor
        for (context, after), _ in (after_prefix + after_token).most_common():
            self.next_of.setdefault(context, after)  # most frequent first: it stays
        self.fallback = collections.Counter(t for s in samples for t in s).most_common(1)[0][0]

    def propose(self, token_ids):
        output, drafts = tuple(token_ids[len(PROMPT):]), []
        for _ in range(self.k):
            draft = self.next_of.get(output, self.next_of.get(output[-1], self.fallback))
            output += (draft,)
            drafts.append(draft)
        return drafts


def draw_with_speculation(make_llm, tiny_llama_dir, monkeypatch, setting, proposer_samples):
    monkeypatch.setattr(actorlm.models.parts, "NgramProposer",
                        lambda k, *_: _EmpiricalProposer(k, proposer_samples))
    llm = make_llm(str(tiny_llama_dir), **ENGINE_FLAGS, speculative_config={
        "method": "ngram", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS})
    return draw(llm, *setting, seed=SETTINGS[setting] + SPEC_SEED_OFFSET), llm.stats()


def cells(pooled):
    """sample -> its cell: its longest prefix seen >= ``MIN_POOLED`` times in ``pooled`` (so a
    frequent prefix's cell holds its samples whose longer prefixes are rare); cells that end up
    rarer than that merge into one."""
    prefix_counts = collections.Counter(s[:n] for s in pooled for n in range(1, MAX_TOKENS + 1))

    def longest_frequent_prefix(sample):
        for n in range(MAX_TOKENS, 0, -1):
            if prefix_counts[sample[:n]] >= MIN_POOLED:
                return sample[:n]
        return ()

    counts = collections.Counter(map(longest_frequent_prefix, pooled))
    return lambda s: (cell if counts[cell := longest_frequent_prefix(s)] >= MIN_POOLED
                      else "rare")


def homogeneity_p_value(a, b) -> tuple[float, int]:
    """(p, number of cells) of Pearson's chi-square test that samples a and b (lists of token
    tuples) come from one law: over the 2 x C table of their cell counts, expected counts from
    the margins, df = C - 1; p = Q(df / 2, stat / 2), which is scipy.stats.chi2.sf (scipy is
    not a dependency)."""
    cell_of = cells(a + b)
    table = collections.defaultdict(lambda: [0, 0])
    for column, sample in enumerate((a, b)):
        for s in sample:
            table[cell_of(s)][column] += 1
    observed = torch.tensor(list(table.values()), dtype=torch.float64)  # [C, 2]
    expected = observed.sum(1, keepdim=True) * observed.sum(0, keepdim=True) / observed.sum()
    assert expected.min() >= 5, "a cell expects fewer than 5: draw more"
    stat = ((observed - expected) ** 2 / expected).sum()
    df = observed.shape[0] - 1
    assert df >= 20, "too few cells to say much: the model's distribution is not spread"
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                   stat / 2).item(), observed.shape[0]


@pytest.mark.slow
@pytest.mark.parametrize("setting", SETTINGS, ids=["temperature-1", "top-p-0.9"])
def test_speculation_keeps_the_distribution_of_the_first_tokens(
        make_llm, tiny_llama_dir, monkeypatch, draws_without_speculation, setting):
    without = draws_without_speculation(setting)
    with_spec, stats = draw_with_speculation(make_llm, tiny_llama_dir, monkeypatch, setting,
                                             without)
    # every request verified drafts after its first token; some were accepted, some not, and
    # some verifications accepted both of their drafts
    assert stats["spec_num_drafts"] >= NUM_DRAWS
    accepted, drafted = stats["spec_num_accepted_tokens"], stats["spec_num_draft_tokens"]
    assert 0.05 * drafted < accepted < 0.95 * drafted, (accepted, drafted)
    assert stats["spec_accepted_per_position"][1] > 0
    assert with_spec != without  # (different seeds: different samples)
    p_value, num_cells = homogeneity_p_value(without, with_spec)
    print(f"{setting}: p = {p_value:.3f} over {num_cells} cells, "
          f"{accepted} of {drafted} drafts accepted")
    assert p_value > SIGNIFICANCE, p_value


def _accept_every_draft(self, logits, num_drafts, draft_token_ids, temperature, top_k, top_p,
                        min_p, seeds, positions):
    """A wrong verifier: every draft accepted, then the bonus row's token drawn as the right
    verifier draws it."""
    bonus_rows = torch.cumsum(torch.tensor(num_drafts) + 1, 0) - 1
    bonus = rejection.rejection_sample(
        logits[bonus_rows], [0] * len(num_drafts), draft_token_ids[:0], temperature, top_k,
        top_p, min_p, seeds, positions + torch.tensor(num_drafts))
    out = torch.full((len(num_drafts), max(num_drafts) + 1), -1, dtype=torch.int64)
    drafts = draft_token_ids.split(num_drafts)
    for b, k in enumerate(num_drafts):
        out[b, :k] = drafts[b]
        out[b, k] = bonus[b, 0]
    return out


@pytest.mark.slow
def test_the_distribution_test_sees_a_verifier_that_accepts_every_draft(
        make_llm, tiny_llama_dir, monkeypatch, draws_without_speculation):
    setting = (1.0, 1.0)
    without = draws_without_speculation(setting)
    monkeypatch.setattr(KernelBackend, "rejection_sample", _accept_every_draft)
    wrong, stats = draw_with_speculation(make_llm, tiny_llama_dir, monkeypatch, setting,
                                         without)
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"] > 0
    p_value, _ = homogeneity_p_value(without, wrong)
    print(f"accept every draft: p = {p_value:.3g}")
    assert p_value < SIGNIFICANCE, p_value


@pytest.mark.slow
def test_the_distribution_test_tells_top_p_from_the_full_distribution(
        draws_without_speculation):
    """The same statistic sees top-p 0.9 (about a tenth of the mass moved) at this many draws."""
    full, truncated = (draws_without_speculation(setting) for setting in SETTINGS)
    p_value, _ = homogeneity_p_value(full, truncated)
    print(f"temperature 1 against top-p 0.9: p = {p_value:.3g}")
    assert p_value < SIGNIFICANCE, p_value
