"""The replay's model: a fake runner whose tokens give the scheduler the recorded run's shape.

Fake tokens are not the recorded ones (``replay`` explains why none may end a request by
accident). What the scheduler needs of them is that every decision it made on the recorded
tokens comes out the same:

- inside a request's recorded chain of block hashes, the runner samples the tokens the chain
  stands for (``token_at``): equal hashes give equal tokens, so the fake KV of a prefix-cache
  hit is what the request expects there;
- at the position where a request finished on a token (EOS, a stop token, a finished grammar)
  it samples ``FINISH_TOKEN``, which the replay gives every request as a stop token. So the
  request ends there and keeps its recorded length caps — which decide how many drafts fit;
- with speculative decoding, after sampling a request it proposes as many drafts as the
  request's next recorded step verified: its own tokens at those positions for as many as
  that step accepted, then a wrong one. It verifies drafts as greedy decoding does (accepted
  while equal to what it samples there), so each verification accepts what the recording's did.
"""

from __future__ import annotations

import bisect

import msgspec

from actorlm.core.block_hash import hash_block
from actorlm.messages import ScheduleStep, StepResult
from actorlm.testing.fake_runner import FakeModelRunner
from actorlm.trace.records import Record, StateChange, StepSummary

# never sampled otherwise: prompt tokens are 1..7 or drawn from a chain, sampled ones >= 10
FINISH_TOKEN = 0


def token_at(chain: list[int], position: int, block_size: int) -> int | None:
    """A fake token for ``position`` drawn from the recorded hash of its block (None past the
    chain): equal hashes give equal tokens, so the fake KV agrees wherever the recording's did."""
    index = position // block_size
    if index >= len(chain):
        return None
    return 10 + hash_block(chain[index], (position % block_size,)) % 990


def token_finish_positions(records: list[Record]) -> dict[str, int]:
    """The position of the token each request finished on (EOS, a stop token, a grammar that
    completed) — not a length cap, which the replay keeps, nor a stop string, which replays as
    its StopRequests."""
    positions = {}
    for r in records:
        if isinstance(r, StateChange) and r.event == "finish" and r.reason == "stop" and \
                not isinstance(r.stop_reason, str):
            positions[r.request_id] = r.num_prompt_tokens + r.num_output_tokens - 1
    return positions


class RecordedDrafts:
    """Per request, each recorded step that ran it: (step, drafts verified, drafts accepted)."""

    def __init__(self, records: list[Record]):
        self._steps: dict[str, list[int]] = {}
        self._drafts: dict[str, list[tuple[int, int]]] = {}
        for s in records:
            if not isinstance(s, StepSummary):
                continue
            for rid, drafts in zip(s.request_ids, s.drafts_per_request()):
                self._steps.setdefault(rid, []).append(s.step)
                self._drafts.setdefault(rid, []).append(drafts)

    def next_after(self, request_id: str, step_id: int) -> tuple[int, int]:
        """(drafts, accepted) of the first recorded step after ``step_id`` that runs the
        request; (0, 0) when none does or that step verifies nothing (a recompute's prefill)."""
        steps = self._steps.get(request_id, ())
        index = bisect.bisect_right(steps, step_id)
        return self._drafts[request_id][index] if index < len(steps) else (0, 0)


class ReplayRunner(FakeModelRunner):
    """Samples chain tokens, finish tokens and the drafts the recording verified (see above)."""

    def __init__(self, chains: dict[str, list[int]], block_size: int, num_blocks: int | None,
                 windows: list[int | None], finish_positions: dict[str, int] | None = None,
                 drafts: RecordedDrafts | None = None):
        super().__init__(block_size=block_size if num_blocks else None,
                         num_blocks=num_blocks or None, windows=windows)
        self.chains, self.chain_block_size = chains, block_size
        self.finish_positions = finish_positions or {}
        self.drafts = drafts

    def _sample(self, state, position: int) -> int:
        if self.finish_positions.get(state.request_id) == position:
            return FINISH_TOKEN
        token = token_at(self.chains.get(state.request_id, ()), position, self.chain_block_size)
        return super()._sample(state, position) if token is None else token

    def execute(self, step: ScheduleStep) -> StepResult:
        # the drafts follow each request's tokens in the step's input (the plain fake computes
        # the tokens it holds): remember where they start, verify them once it has sampled
        first_draft = {}
        for data, drafts in zip(step.cached_requests, step.spec_token_ids):
            state = self.requests.get(data.request_id)
            if drafts and state is not None:
                first_draft[data.request_id] = len(state.token_ids)
                state.token_ids.extend(drafts)
        result = super().execute(step)
        if self.drafts is None:
            return result
        sampled, accepted, proposed = list(result.sampled_token_ids), [], []
        for i, request_id in enumerate(result.request_ids):
            state = self.requests[request_id]
            start = first_draft.get(request_id)
            if start is None:
                accepted.append([])
            else:
                drafts = state.token_ids[start:-1]  # (the token after them was just sampled)
                num_accepted = 0
                while num_accepted < len(drafts) and \
                        drafts[num_accepted] == self._sample(state, start + num_accepted):
                    num_accepted += 1
                del state.token_ids[start + num_accepted:]  # rejected: their KV is not valid
                state.num_computed_tokens = len(state.token_ids)
                sampled[i] = self._sample(state, len(state.token_ids))
                state.token_ids.append(sampled[i])
                accepted.append(drafts[:num_accepted])
            proposed.append(self._propose(state, step.step_id))
        if not any(accepted) and not any(proposed):
            return result
        return msgspec.structs.replace(result, sampled_token_ids=sampled,
                                       accepted_token_ids=accepted, spec_token_ids=proposed)

    def _propose(self, state, step_id: int) -> list[int]:
        num_drafts, num_accepted = self.drafts.next_after(state.request_id, step_id)
        start = len(state.token_ids)
        right = [self._sample(state, start + j) for j in range(num_drafts)]
        # a draft that is not what it samples there: rejected, with all after it
        return right[:num_accepted] + [t + 1 for t in right[num_accepted:]]
