"""The CPU's sampler (``actorlm.kernels.cpu.sampler.sample``, production torch code) against
the oracle, ``reference.sampling_probs_ref``, by the same checks as the Triton sampler
(``sampling_checks``): greedy rows take its argmax, draws never leave its support, seeded rows
ignore their neighbours, and draws pass the chi-square test against its distribution."""

from __future__ import annotations

import pytest

from actorlm.kernels.cpu.sampler import sample
from sampling_checks import (CASES, assert_draws_follow_the_oracle,
                             assert_greedy_is_the_oracles_argmax, assert_in_support,
                             assert_seeded_rows_ignore_their_batch_neighbours, call,
                             truncation_case)


def test_greedy_is_the_oracles_argmax_with_lowest_index_on_ties():
    assert_greedy_is_the_oracles_argmax(sample)


def test_truncation_never_returns_a_masked_token():
    logits, params = truncation_case()
    assert_in_support(call(sample, logits, params), logits, params)


def test_seeded_rows_ignore_their_batch_neighbours():
    assert_seeded_rows_ignore_their_batch_neighbours(sample)


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_draws_follow_the_oracle(case):
    assert_draws_follow_the_oracle(sample, case)
