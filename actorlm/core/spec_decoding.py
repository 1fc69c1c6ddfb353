"""What speculative decoding's verifications accepted, counted as vLLM's metrics count it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodingCounts:
    num_drafts: int = 0  # verifications: one per request and step that had drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [j]: verifications whose draft at position j was accepted (so the list never rises)
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification: the accepted drafts and the token drawn after them."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0
