"""Where a step's time goes: the model's forward, sampling, and everything else.

The runner times its own phases (``StepSummary.prepare_s``, ``forward_s``, ``sample_s``). A
step's period is the time from its plan to the next step's plan while the engine stays busy;
what the forward and sampling do not account for is the engine's own work — input
preparation, scheduling, the messages between actors, applying the output — which is the
overhead that no faster kernel removes.

A mixture-of-experts model's steps also say how much of the forward its routers and its experts
took (``router_s``, ``experts_s``): ``router_ms`` and ``experts_ms``, absent where no step
measured them (a dense model, a GPU).
"""

from __future__ import annotations

import statistics

from actorlm.trace.records import Record, StepSummary

_IDLE_GAP_S = 0.005  # a step whose result was applied this long before the next plan: idle


def breakdown(records: list[Record], since: float = float("-inf")) -> dict:
    """Medians over the busy steps planned at or after ``since`` (monotonic seconds), split
    into decode-only steps and steps with prefill, in milliseconds."""
    steps = [r for r in records if isinstance(r, StepSummary) and r.t_start >= since
             and r.request_ids and r.fault is None]
    busy = [(s, nxt.t_start - s.t_start) for s, nxt in zip(steps, steps[1:])
            if nxt.t_start - s.t_end < _IDLE_GAP_S]
    out = {"num_steps": len(busy)}
    for kind, chosen in (("decode", [b for b in busy if b[0].num_prefill_tokens == 0]),
                         ("prefill", [b for b in busy if b[0].num_prefill_tokens > 0])):
        if not chosen:
            continue
        out[kind] = {
            "num_steps": len(chosen),
            "num_requests": statistics.median(s.num_requests for s, _ in chosen),
            "step_ms": _ms(period for _, period in chosen),
            "forward_ms": _ms(s.forward_s for s, _ in chosen),
            "sample_ms": _ms(s.sample_s for s, _ in chosen),
            "prepare_ms": _ms(s.prepare_s for s, _ in chosen),
            # everything but the forward and sampling, input preparation included
            "engine_overhead_ms": _ms(period - s.forward_s - s.sample_s for s, period in chosen),
        }
        timed = [s for s, _ in chosen if s.router_s is not None]
        if timed:
            out[kind]["router_ms"] = _ms(s.router_s for s in timed)
            out[kind]["experts_ms"] = _ms(s.experts_s for s in timed)
    return out


def _ms(values) -> float:
    return round(1e3 * statistics.median(values), 3)
