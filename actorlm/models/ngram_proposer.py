"""Prompt lookup: draft tokens copied from where the request's own text repeated itself.

The request's last n tokens (its suffix) are searched for earlier in its prompt and output; the
tokens that followed the match are the drafts. The longest suffix of ``prompt_lookup_max`` down
to ``prompt_lookup_min`` tokens that occurs earlier wins, and of its occurrences the most recent
(the one closest in topic). One pass over the tokens finds every length at once: positions
where the last token recurs, narrowed step by step as the match extends backwards. This is
what makes input-grounded work (summaries that quote, code edits, retrieval answers) cheap to
speculate: the drafts are right whenever the output copies its input.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int,
                 prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose_all(self, request_ids: list[str], token_ids: list[list[int]]) -> list[list[int]]:
        """The drafts of each request (the runner's proposer protocol, ``speculative.Proposer``)."""
        return [self.propose(tokens) for tokens in token_ids]

    def forget(self, request_id: str) -> None:
        """Nothing to forget: prompt lookup keeps no state between steps."""

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """No KV cache: prompt lookup runs no model."""

    def propose(self, token_ids: list[int]) -> list[int]:
        """Up to ``k`` drafts to follow ``token_ids`` (prompt + output); [] without a match."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if length <= self.min_n:
            return []
        # ends[i]: an earlier position whose token equals the last one, so the tokens after it
        # (from ends[i] + 1) would continue the text as it went on back then
        ends = np.flatnonzero(tokens[:-1] == tokens[-1])
        best, best_n = None, 0
        for n in range(1, self.max_n + 1):
            if len(ends) == 0:
                break
            if n >= self.min_n:
                best, best_n = ends[-1], n  # the most recent match of this length
            if n == self.max_n or n >= length - 1:
                break
            ends = ends[ends >= n]  # room for one more token before the match
            ends = ends[tokens[ends - n] == tokens[length - 1 - n]]
        if best is None:
            return []
        return tokens[best + 1:best + 1 + self.k].tolist()
