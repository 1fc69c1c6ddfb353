"""A proposer for tests of speculative decoding on random models, which rarely repeat
themselves (so prompt lookup would rarely be right about them)."""

from actorlm.models.ngram_proposer import NgramProposer


class KnowingProposer(NgramProposer):
    """Proposes each request's true continuation (one of ``sequences``: prompt + the output of
    the engine without speculation), with the draft at ``len % (k + 2)`` wrong when that is a
    draft's index: k of every k + 2 proposals have one bad draft, so every verification
    outcome occurs (none accepted, some, all of them and the bonus)."""

    def __init__(self, sequences, k, vocab_size=200):  # (its batch and forget: prompt lookup's)
        self.sequences, self.k, self.vocab_size = sequences, k, vocab_size

    def propose(self, token_ids):
        n = len(token_ids)
        for sequence in self.sequences:
            if sequence[:n] == token_ids:
                drafts = sequence[n:n + self.k]
                if (bad := n % (self.k + 2)) < len(drafts):
                    drafts[bad] = (drafts[bad] + 1) % self.vocab_size
                return drafts
        return []
