"""NgramProposer (prompt lookup): which earlier match its drafts are copied from.

The proposer narrows candidate positions in one pass over all suffix lengths at once, which is
easy to get subtly wrong (off by one at the ends, overlapping repeats, a longer match losing to
a more recent shorter one). It is held to a brute-force reference that states the rule
directly, on random sequences, and to hand-written cases with their expected drafts.
"""

from __future__ import annotations

import random

import pytest

from actorlm.models.ngram_proposer import NgramProposer


def propose_ref(token_ids, k, min_n, max_n):
    """The rule itself: for n from ``max_n`` down to ``min_n``, the most recent earlier start
    of the last n tokens wins; its drafts are the up to k tokens after it."""
    length = len(token_ids)
    for n in range(max_n, min_n - 1, -1):
        suffix = token_ids[length - n:] if n <= length else None
        for start in range(length - n - 1, -1, -1):  # the suffix itself starts at length - n
            if token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + k]
    return []


# (token_ids, k, min_n, max_n, expected drafts)
CASES = {
    "suffix-found": ([1, 2, 3, 4, 1, 2], 3, 1, 3, [3, 4, 1]),
    "most-recent-occurrence": ([1, 2, 7, 1, 2, 8, 1, 2], 3, 1, 2, [8, 1, 2]),
    # [5, 6, 7] occurs at 0; the shorter [6, 7] later at 5 and [7] later still at 8
    "longest-wins-over-more-recent": ([5, 6, 7, 9, 8, 6, 7, 0, 7, 5, 6, 7], 3, 1, 3, [9, 8, 6]),
    "longest-capped-at-max": ([5, 6, 7, 9, 8, 6, 7, 0, 7, 5, 6, 7], 3, 1, 2, [0, 7, 5]),
    "shortest-when-max-is-1": ([5, 6, 7, 9, 8, 6, 7, 0, 7, 5, 6, 7], 3, 1, 1, [5, 6, 7]),
    "fewer-near-the-end": ([1, 2, 3, 1, 2], 5, 1, 3, [3, 1, 2]),
    "one-left-at-the-end": ([4, 9, 4], 3, 1, 3, [9, 4]),
    # [1, 1] starts at 0 and (overlapping it) at 1: the later one, so the drafts begin at 3
    "overlapping-repeats": ([1, 1, 1, 2, 1, 1], 3, 1, 3, [2, 1, 1]),
    "all-equal": ([1, 1, 1, 1], 3, 1, 3, [1]),
    "all-equal-longest-is-length-minus-1": ([2, 2, 2, 2, 2], 2, 4, 6, [2]),
    "max-beyond-the-length": ([3, 3], 4, 1, 5, [3]),
    "k-caps-the-drafts": ([1, 2, 3, 4, 5, 6, 1], 2, 1, 3, [2, 3]),
    "no-match": ([1, 2, 3, 4], 3, 1, 3, []),
    "match-only-shorter-than-min": ([1, 2, 3, 1], 3, 2, 3, []),
    "too-short-for-min": ([7, 7], 3, 2, 3, []),
    "single-token": ([5], 3, 1, 3, []),
    "empty": ([], 3, 1, 3, []),
}


@pytest.mark.parametrize("token_ids, k, min_n, max_n, expected", CASES.values(),
                         ids=CASES.keys())
def test_hand_written_cases(token_ids, k, min_n, max_n, expected):
    assert propose_ref(token_ids, k, min_n, max_n) == expected  # the reference agrees, too
    drafts = NgramProposer(k, min_n, max_n).propose(token_ids)
    assert drafts == expected
    assert all(type(d) is int for d in drafts)


@pytest.mark.parametrize("k, min_n, max_n", [(3, 1, 3), (5, 2, 4), (2, 1, 1), (4, 3, 5),
                                             (1, 2, 2), (6, 1, 8)])
def test_matches_the_brute_force_reference(k, min_n, max_n):
    """300 random sequences of 0 to 16 tokens over an alphabet of 2 to 4, so repeats, overlaps
    and near misses are common."""
    rng = random.Random(1000 * k + 10 * min_n + max_n)
    proposer = NgramProposer(k, min_n, max_n)
    num_matched = 0
    for _ in range(300):
        alphabet = rng.randint(2, 4)
        token_ids = [rng.randrange(alphabet) for _ in range(rng.randint(0, 16))]
        expected = propose_ref(token_ids, k, min_n, max_n)
        assert proposer.propose(token_ids) == expected, token_ids
        num_matched += bool(expected)
    assert 30 < num_matched < 300  # both outcomes were exercised
