"""What the EngineHarness keeps: one record per request and one per step."""

from __future__ import annotations

from dataclasses import dataclass, field

from actorlm.fsm import RequestEvent, RequestState
from actorlm.messages import EngineOutputs, ScheduleStep, StepResult


@dataclass
class RequestRecord:
    """Everything the harness saw of one engine-side request (kept after it finishes)."""

    request_id: str
    prompt_token_ids: list[int] = field(default_factory=list)
    state: RequestState = RequestState.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    transitions: list[tuple[RequestState, RequestEvent, RequestState]] = field(default_factory=list)
    arrival_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_finish_deltas: int = 0  # deltas that carried a finish_reason: must end at exactly 1

    @property
    def is_finished(self) -> bool:
        return self.state is RequestState.FINISHED

    @property
    def num_preemptions(self) -> int:
        return sum(1 for _, event, _ in self.transitions if event is RequestEvent.PREEMPT)


@dataclass
class StepRecord:
    """What one ``step()`` did: the step that ran, its result, what the frontend was sent, and
    the state transitions the scheduler made while applying it and planning the next step."""

    step: ScheduleStep
    result: StepResult
    outputs: list[EngineOutputs]
    transitions: list[tuple[str, RequestState, RequestEvent, RequestState]]
    time: float | None

    @property
    def request_ids(self) -> list[str]:
        return [d.request_id for d in self.step.new_requests + self.step.cached_requests]

    @property
    def scheduled(self) -> dict[str, int]:
        """Request id -> tokens computed for it in this step."""
        return dict(zip(self.request_ids, self.step.num_scheduled_tokens))

    @property
    def num_tokens(self) -> int:
        return sum(self.step.num_scheduled_tokens)

    @property
    def num_seqs(self) -> int:
        return len(self.step.num_scheduled_tokens)

    @property
    def new_tokens(self) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {}
        for outputs in self.outputs:
            for delta in outputs.deltas:
                if delta.new_token_ids:
                    tokens.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        return tokens

    @property
    def finished(self) -> dict[str, str]:
        """Request id -> finish reason, for every request that finished during this step."""
        return {d.request_id: d.finish_reason for o in self.outputs for d in o.deltas
                if d.finish_reason is not None}

    @property
    def preempted_ids(self) -> list[str]:
        return [rid for rid, _, event, _ in self.transitions if event is RequestEvent.PREEMPT]
