"""One step's plan: what the scheduler proposes to the allocator (``allocate_message``) and,
once the grant is applied, what the step runs — read by the step loop and the trace recorder."""

from __future__ import annotations

from dataclasses import dataclass, field

from actorlm.core.request import Request
from actorlm.messages import AllocateSlots, Candidate, ComputedBlocks, SlotsGranted


@dataclass
class StepPlan:
    """What ``schedule()`` proposes (one AllocateSlots) and, once granted, what the step runs."""

    step_id: int
    running: list[Request] = field(default_factory=list)  # priority order: preempted from the end
    running_tokens: list[int] = field(default_factory=list)  # 0: past the token budget
    candidates: list[tuple[Request, int]] = field(default_factory=list)  # (request, max tokens)
    free_request_ids: list[str] = field(default_factory=list)
    computed_blocks: list[ComputedBlocks] = field(default_factory=list)
    reset_prefix_cache: bool = False
    # set when granted
    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    is_prefill: list[bool] = field(default_factory=list)  # False: computes just its newest token
    preempted_ids: list[str] = field(default_factory=list)
    num_cached_tokens: int = 0  # prefix-cache hits of the requests admitted
    on_trial: str | None = None  # a request on probation, which the step runs alone

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    def runs_with(self, granted: SlotsGranted) -> bool:
        """Whether the step runs any request once ``granted`` decides it."""
        return bool(granted.admitted) or any(self.running_tokens[:len(granted.new_block_ids)])

    @property
    def is_empty(self) -> bool:
        return not (any(self.running_tokens) or self.candidates or self.free_request_ids
                    or self.computed_blocks or self.reset_prefix_cache)

    def allocate_message(self, block_size: int) -> AllocateSlots:
        computed = [r.num_computed_tokens for r in self.running]  # sliding windows start here
        lengths = [c + n for c, n in zip(computed, self.running_tokens)]
        candidates = [Candidate(r.request_id, r.num_tokens, n,
                                r.block_hashes[:(r.num_tokens - 1) // block_size])
                      for r, n in self.candidates]
        return AllocateSlots(self.step_id, self.free_request_ids,
                             [r.request_id for r in self.running], lengths, candidates,
                             self.computed_blocks, self.reset_prefix_cache, computed)
