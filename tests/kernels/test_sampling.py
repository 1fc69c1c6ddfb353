"""sample (Triton, interpreted on the CPU): greedy, distributions, seeds.

Judged by the oracle, ``reference.sampling_probs_ref``, as the CPU sampler is
(``test_cpu_sampler``): greedy rows take its argmax, sampled rows pass the chi-square test of
``sampling_checks`` against its distribution.
"""

from __future__ import annotations

import pytest
import torch

from actorlm.kernels.triton import sampling
from actorlm.kernels.triton.sampling import sample
from sampling_checks import (CASES, LOGITS, NUM_DRAWS, assert_draws_follow_the_oracle,
                             assert_greedy_is_the_oracles_argmax, assert_in_support,
                             assert_seeded_rows_ignore_their_batch_neighbours, call,
                             oracle_probs, sampling_params, truncation_case)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_draws_follow_the_oracle(case):
    assert_draws_follow_the_oracle(sample, case)


def test_greedy_is_the_oracles_argmax_with_lowest_index_on_ties():
    assert_greedy_is_the_oracles_argmax(sample)


def test_greedy_rows_mixed_with_sampled_rows():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 40, generator=gen)
    p = sampling_params(64, temperature=1.0)
    p["temperature"][::3] = 0.0
    tokens = call(sample, logits, p)
    greedy = p["temperature"] == 0.0
    assert torch.equal(tokens[greedy], oracle_probs(logits, p)[greedy].argmax(dim=-1))
    assert not torch.equal(tokens[~greedy], logits[~greedy].argmax(dim=-1))  # sampled rows vary


def test_degenerate_truncations_reduce_to_argmax():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(30, 50, generator=gen)
    p = sampling_params(30, temperature=1.0)
    p["top_k"][:10] = 1  # one candidate
    p["top_p"][10:20] = 1e-6  # the smallest head is the top token
    p["min_p"][20:] = 1.0  # only tokens as likely as the best
    assert torch.equal(call(sample, logits, p), oracle_probs(logits, p).argmax(dim=-1))


def test_truncation_never_returns_a_masked_token():
    logits, p = truncation_case()
    assert_in_support(call(sample, logits, p), logits, p)


def test_top_k_at_or_beyond_vocab_size_is_off():
    logits = LOGITS.expand(NUM_DRAWS // 4, -1).contiguous()
    disabled = call(sample, logits, sampling_params(logits.shape[0], top_k=0))
    for top_k in (LOGITS.numel(), 1000):
        params = sampling_params(logits.shape[0], top_k=top_k)
        assert torch.equal(call(sample, logits, params), disabled)


def test_seeded_rows_ignore_their_batch_neighbours():
    assert_seeded_rows_ignore_their_batch_neighbours(sample)


def test_chunked_vocabulary_matches_single_chunk(monkeypatch):
    # A large vocabulary is streamed in chunks, one row per program; force that path on a small
    # one. Noise depends only on (seed, position, token), so the draws must be identical.
    gen = torch.Generator().manual_seed(4)
    num_rows, vocab_size = 8, 40
    logits = torch.randn(num_rows, vocab_size, generator=gen) * 2
    logits[0, [3, 35]] = 20.0  # greedy tie across chunks
    p = sampling_params(num_rows, temperature=1.2)
    p["temperature"][0] = 0.0
    p["top_k"][[1, 4]] = 7
    p["top_p"][[2, 4]] = 0.75
    p["min_p"][[3, 4]] = 0.1
    single = call(sample, logits, p)
    monkeypatch.setattr(sampling, "_MAX_BLOCK_V", 16)
    chunked = call(sample, logits, p)
    assert single[0].item() == 3
    assert torch.equal(chunked, single)
