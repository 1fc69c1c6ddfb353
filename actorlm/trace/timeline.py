"""From records to lanes: each request's life as contiguous state segments.

Both exports (Perfetto, HTML) draw the same picture, so both start here. A request's lane
starts at its arrival (or at its first transition when the ring buffer lost the arrival) and
is cut at every transition; a running stretch is further cut where its steps switch between
prefill and decode. A finished request ends with a zero-length ``finished`` segment carrying
the reason. A request still live when the trace ends has ``is_open`` set.

Prefix-cache hits come from the transitions into ``running``: each carries the tokens its
admission found cached. A lane shows its first admission's (later ones re-admit a preempted
request, whose hit is mostly its own earlier work); the cache-hit rate counts every admission,
as the share of the tokens to admit that the cache already held.

Speculative decoding: a running segment counts the draft tokens its steps verified and how many
of them they accepted, and its lane the same over the request's life; ``Lane.verifications``
lists each verification as (step summary, drafts, accepted), for the lane's marks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from actorlm.messages import engine_request_ids
from actorlm.trace.records import (Abort, Arrival, MessageSent, Record, StateChange,
                                   StepSummary, Stop, TraceConfig)


@dataclass
class Segment:
    state: str  # waiting | running | preempted | finished
    t_start: float
    t_end: float
    step_start: int
    step_end: int
    phase: str | None = None  # running only: prefill | decode (None: no step seen)
    num_tokens: int = 0  # tokens computed in this segment
    num_steps: int = 0
    num_blocks: int = 0  # blocks held when the segment ended (running) or at the finish
    reason: str | None = None  # finished only
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0  # first running segment of a stay: the admission's cache hit
    num_draft_tokens: int = 0  # running only: drafts its steps verified
    num_accepted_tokens: int = 0  # ... and accepted


@dataclass
class Lane:
    request_id: str
    arrival: Arrival | None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # found in the prefix cache at its first admission
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    segments: list[Segment] = field(default_factory=list)
    is_open: bool = False  # still live when the trace ends
    verifications: list[tuple[StepSummary, int, int]] = field(default_factory=list)

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter the request ran with (None: the base model, or no arrival)."""
        return self.arrival.lora_name if self.arrival is not None else None

    @property
    def num_draft_tokens(self) -> int:
        return sum(d for _, d, _ in self.verifications)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(a for _, _, a in self.verifications)

    @property
    def t_end(self) -> float:
        return self.segments[-1].t_end if self.segments else 0.0


@dataclass
class Timeline:
    config: TraceConfig | None
    lanes: list[Lane]
    steps: list[StepSummary]
    messages: list[MessageSent]
    controls: list[Abort | Stop]
    t_min: float
    t_max: float
    num_cached_tokens: int = 0  # over every admission (transition into running)
    num_admitted_tokens: int = 0  # prompt + output tokens at those admissions

    @property
    def cache_hit_rate(self) -> float | None:
        """Share of the admitted tokens found in the prefix cache (None: nothing admitted)."""
        return self.num_cached_tokens / self.num_admitted_tokens if self.num_admitted_tokens \
            else None


def build_timeline(records: list[Record]) -> Timeline:
    config = records[0] if records and isinstance(records[0], TraceConfig) else None
    arrivals: dict[str, Arrival] = {}
    transitions: dict[str, list[StateChange]] = {}
    step_runs: dict[str, list[_Run]] = {}
    steps, messages, controls, order = [], [], [], []
    times = []
    num_cached = num_admitted = 0
    for record in records:
        if isinstance(record, Arrival):
            for rid in engine_request_ids(record.request_id, record.n):
                arrivals[rid] = record
                if rid not in transitions:
                    transitions[rid] = []
                    order.append(rid)
            times.append(record.t)
        elif isinstance(record, StateChange):
            if record.request_id not in transitions:
                transitions[record.request_id] = []
                order.append(record.request_id)
            transitions[record.request_id].append(record)
            times.append(record.t)
            if record.target == "running":
                num_cached += record.num_cached_tokens
                num_admitted += record.num_prompt_tokens + record.num_output_tokens
        elif isinstance(record, StepSummary):
            steps.append(record)
            for rid, n, prefill, (d, a) in zip(record.request_ids, record.num_scheduled_tokens,
                                               record.is_prefill, record.drafts_per_request()):
                step_runs.setdefault(rid, []).append(_Run(record, n, prefill, d, a))
            times += (record.t_start, record.t_end)
        elif isinstance(record, MessageSent):
            messages.append(record)
            times.append(record.t)
        elif isinstance(record, (Abort, Stop)):
            controls.append(record)
            times.append(record.t)
    t_min = min(times) if times else 0.0
    t_max = max(times) if times else 0.0
    last_step = steps[-1].step if steps else 0
    lanes = [_lane(rid, arrivals.get(rid), transitions[rid], step_runs.get(rid, []), t_max,
                   last_step) for rid in order]
    return Timeline(config, lanes, steps, messages, controls, t_min, t_max, num_cached,
                    num_admitted)


@dataclass(frozen=True)
class _Run:
    """One step's work for one request."""

    step: StepSummary
    num_tokens: int
    is_prefill: bool
    num_drafts: int = 0
    num_accepted: int = 0


def _lane(request_id: str, arrival: Arrival | None, changes: list[StateChange],
          runs: list[_Run], t_max: float, last_step: int) -> Lane:
    lane = Lane(request_id, arrival)
    lane.verifications = [(r.step, r.num_drafts, r.num_accepted) for r in runs if r.num_drafts]
    if arrival is not None:
        lane.num_prompt_tokens = arrival.num_prompt_tokens
        state, t, step = "waiting", arrival.t, arrival.step
    elif changes:
        first = changes[0]
        state, t, step = first.source, first.t, first.step
    else:
        return lane
    cached, admitted = 0, False  # the hit of the admission that began this running stay
    for change in changes:
        _close(lane, state, t, change.t, step, change.step, runs, change.num_blocks, cached)
        lane.num_prompt_tokens = change.num_prompt_tokens
        lane.num_output_tokens = max(lane.num_output_tokens, change.num_output_tokens)
        if change.event == "preempt":
            lane.num_preemptions += 1
        if change.target == "running":
            cached = change.num_cached_tokens
            if not admitted:
                lane.num_cached_tokens, admitted = cached, True
        state, t, step = change.target, change.t, change.step
        if state == "finished":
            lane.finish_reason, lane.stop_reason = change.reason, change.stop_reason
            lane.segments.append(Segment("finished", t, t, step, step,
                                         num_blocks=change.num_blocks, reason=change.reason,
                                         stop_reason=change.stop_reason))
            return lane
    _close(lane, state, t, t_max, step, last_step, runs, None, cached)
    lane.is_open = True
    return lane


def _close(lane: Lane, state: str, t_start: float, t_end: float, step_start: int,
           step_end: int, runs: list[_Run], num_blocks: int | None, num_cached: int) -> None:
    """Append the segment(s) of one stay in ``state``; running stays split by phase."""
    if state != "running":
        lane.segments.append(Segment(state, t_start, t_end, step_start, step_end,
                                     num_blocks=num_blocks or 0))
        return
    inside = [r for r in runs if t_start <= r.step.t_start <= t_end]
    if not inside:
        lane.segments.append(Segment(state, t_start, t_end, step_start, step_end,
                                     num_blocks=num_blocks or 0, num_cached_tokens=num_cached))
        return
    groups: list[list[_Run]] = []
    for run in inside:
        if groups and groups[-1][-1].is_prefill == run.is_prefill:
            groups[-1].append(run)
        else:
            groups.append([run])
    start = t_start
    for index, group in enumerate(groups):
        last = index == len(groups) - 1
        end = t_end if last else group[-1].step.t_end
        lane.segments.append(Segment(
            "running", start, end, group[0].step.step, group[-1].step.step,
            phase="prefill" if group[0].is_prefill else "decode",
            num_tokens=sum(r.num_tokens for r in group), num_steps=len(group),
            num_blocks=(num_blocks or 0) if last else 0,
            num_cached_tokens=num_cached if index == 0 else 0,
            num_draft_tokens=sum(r.num_drafts for r in group),
            num_accepted_tokens=sum(r.num_accepted for r in group)))
        start = end
