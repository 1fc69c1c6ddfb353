"""Export a trace to the Chrome / Perfetto trace-event JSON format (opens in ui.perfetto.dev).

Three processes: "requests" has one track per request (its state spans as complete ``X``
events, the prefill/decode stretches of a running span nested inside it, the finish as an
instant); "actors" has one track per sending actor with its messages as instants; "engine"
has the steps as ``X`` events and counters (``C``) for KV blocks and batch size, and one track
per worker rank with its input preparation, forward and sampling of each step (laid end to end
so that they end with the step: a rank's own clock is not this process's); inside rank 0's
forward of a mixture-of-experts model, its routers' and its experts' time, each summed over the
layers (so laid end to end too, not where each layer ran them). With speculative decoding a
step's args say how many drafts it verified and accepted (``drafts``: per request, [drafts,
accepted]), a decode span's args the same over its steps, and a "drafts" counter follows them
per step. Timestamps
are microseconds from the first record; events are sorted by time, so every track's are
monotonic.
"""

from __future__ import annotations

import json

from actorlm.trace.records import Record
from actorlm.trace.timeline import Timeline, build_timeline

_REQUESTS, _ACTORS, _ENGINE = 1, 2, 3
_ACTOR_ORDER = ("frontend", "scheduler", "allocator", "executor", "worker")
_RANK_PHASES = ("prepare", "forward", "sample")  # StepResult.timings, in order


def to_perfetto(records: list[Record]) -> dict:
    """The trace as a trace-event JSON object (``{"traceEvents": [...], ...}``)."""
    timeline = build_timeline(records)
    t0 = timeline.t_min

    def us(t: float) -> float:
        return round((t - t0) * 1e6, 3)

    meta: list[dict] = []
    events: list[dict] = []
    for pid, name, index in ((_REQUESTS, "requests", 0), (_ACTORS, "actors", 1),
                             (_ENGINE, "engine", 2)):
        meta.append(_meta("process_name", pid, 0, name))
        meta.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                     "args": {"sort_index": index}})
    _requests(timeline, us, meta, events)
    _actors(timeline, us, meta, events)
    _engine(timeline, us, meta, events)
    events.sort(key=lambda e: e["ts"])  # stable: a parent span stays before its children
    other = {"producer": "actorlm"}
    if timeline.config is not None:
        other.update({k: v for k, v in _config_items(timeline.config)})
    if timeline.cache_hit_rate is not None:  # the share of admitted tokens found cached
        other["cache_hit_rate"] = round(timeline.cache_hit_rate, 4)
    return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": other}


def write_perfetto(records: list[Record], path) -> None:
    with open(path, "w") as f:
        json.dump(to_perfetto(records), f, separators=(",", ":"))


def _config_items(config):
    for name in ("model", "max_num_batched_tokens", "max_num_seqs", "max_model_len",
                 "block_size", "num_kv_blocks", "enable_chunked_prefill", "num_dropped",
                 "kv_cache_windows", "num_speculative_tokens", "max_loras", "scheduling_policy",
                 "long_prefill_token_threshold"):
        yield name, getattr(config, name)


def _meta(kind: str, pid: int, tid: int, name: str) -> dict:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}


def _requests(timeline: Timeline, us, meta: list, events: list) -> None:
    for tid, lane in enumerate(timeline.lanes, 1):
        adapter = f" ({lane.lora_name})" if lane.lora_name is not None else ""
        meta.append(_meta("thread_name", _REQUESTS, tid, f"request {lane.request_id}{adapter}"))
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": _REQUESTS, "tid": tid,
                     "args": {"sort_index": tid}})
        segments = lane.segments
        i = 0
        while i < len(segments):
            seg = segments[i]
            if seg.state == "finished":
                events.append({"name": f"finished ({seg.reason})", "cat": "request", "ph": "i",
                               "s": "t", "ts": us(seg.t_start), "pid": _REQUESTS, "tid": tid,
                               "args": {"reason": seg.reason, "stop_reason": seg.stop_reason,
                                        "step": seg.step_start,
                                        "num_output_tokens": lane.num_output_tokens}})
                i += 1
                continue
            j = i + 1  # a running stay spans consecutive running segments (one per phase)
            while seg.state == "running" and j < len(segments) and segments[j].state == "running":
                j += 1
            stay = segments[i:j]
            args = {"step_start": seg.step_start, "step_end": stay[-1].step_end,
                    "num_prompt_tokens": lane.num_prompt_tokens}
            if seg.state == "running":
                args.update(num_tokens=sum(s.num_tokens for s in stay),
                            num_steps=sum(s.num_steps for s in stay),
                            num_blocks=stay[-1].num_blocks,
                            num_cached_tokens=seg.num_cached_tokens)
            events.append(_span(seg.state, "request", us(seg.t_start), us(stay[-1].t_end),
                                _REQUESTS, tid, args))
            for part in stay:
                if part.phase is not None:
                    events.append(_span(part.phase, "request", us(part.t_start), us(part.t_end),
                                        _REQUESTS, tid,
                                        {"num_tokens": part.num_tokens,
                                         "num_steps": part.num_steps,
                                         "step_start": part.step_start,
                                         "step_end": part.step_end, **_draft_args(part)}))
            i = j


def _draft_args(part) -> dict:
    if not part.num_draft_tokens:
        return {}
    return {"num_draft_tokens": part.num_draft_tokens,
            "num_accepted_tokens": part.num_accepted_tokens}


def _step_draft_args(s) -> dict:
    if not s.draft_token_ids:
        return {}
    return {"num_draft_tokens": s.num_draft_tokens, "num_accepted_tokens": s.num_accepted_drafts,
            "drafts": {rid: [d, a] for rid, (d, a) in zip(s.request_ids, s.drafts_per_request())
                       if d}}


def _span(name: str, cat: str, start: float, end: float, pid: int, tid: int, args: dict) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "ts": start,
            "dur": round(max(0.0, end - start), 3), "pid": pid, "tid": tid, "args": args}


def _actors(timeline: Timeline, us, meta: list, events: list) -> None:
    senders = {m.sender for m in timeline.messages}
    names = [n for n in _ACTOR_ORDER if n in senders] + sorted(senders - set(_ACTOR_ORDER))
    tids = {name: tid for tid, name in enumerate(names, 1)}
    for name, tid in tids.items():
        meta.append(_meta("thread_name", _ACTORS, tid, name))
        meta.append({"name": "thread_sort_index", "ph": "M", "pid": _ACTORS, "tid": tid,
                     "args": {"sort_index": tid}})
    for m in timeline.messages:
        events.append({"name": m.type, "cat": "message", "ph": "i", "s": "t", "ts": us(m.t),
                       "pid": _ACTORS, "tid": tids[m.sender],
                       "args": {"to": m.receiver, "bytes": m.num_bytes, "step": m.step}})


def _moe_spans(step, t_forward: float, us, events: list) -> None:
    """The routers' and the experts' seconds of ``step``, from the start of rank 0's forward."""
    t_routed = t_forward + step.router_s
    args = {"step": step.step, "summed_over_layers": True}
    events.append(_span("router", "moe", us(t_forward), us(t_routed), _ENGINE, 2, args))
    events.append(_span("experts", "moe", us(t_routed), us(t_routed + step.experts_s), _ENGINE,
                        2, args))


def _engine(timeline: Timeline, us, meta: list, events: list) -> None:
    meta.append(_meta("thread_name", _ENGINE, 1, "steps"))
    total = timeline.config.num_kv_blocks if timeline.config is not None else None
    num_ranks = max((len(s.rank_timings) for s in timeline.steps), default=0)
    speculative = any(s.draft_token_ids for s in timeline.steps)
    for rank in range(num_ranks):
        meta.append(_meta("thread_name", _ENGINE, 2 + rank, f"rank {rank}"))
    for s in timeline.steps:
        for rank, timings in enumerate(s.rank_timings):
            t = s.t_end - sum(timings)
            for phase, seconds in zip(_RANK_PHASES, timings):
                events.append(_span(phase, "rank", us(t), us(t + seconds), _ENGINE, 2 + rank,
                                    {"step": s.step, "rank": rank}))
                if phase == "forward" and rank == 0 and s.router_s is not None:
                    _moe_spans(s, t, us, events)
                t += seconds
        events.append(_span(f"step {s.step}", "step", us(s.t_start), us(s.t_end), _ENGINE, 1, {
            "step": s.step, "num_requests": s.num_requests,
            "num_prefill_tokens": s.num_prefill_tokens, "num_decode_tokens": s.num_decode_tokens,
            "preempted_ids": s.preempted_ids, "failed_ids": s.failed_ids,
            "kv_blocks_used": s.kv_blocks_used, "kv_blocks_free": s.kv_blocks_free,
            "kv_blocks_cached": s.kv_blocks_cached, "num_cached_tokens": s.num_cached_tokens,
            "scheduled": dict(zip(s.request_ids, s.num_scheduled_tokens)),
            **_step_draft_args(s)}))
        ts = us(s.t_start)
        kv = {"used": s.kv_blocks_used, "free": s.kv_blocks_free, "cached": s.kv_blocks_cached}
        if len(s.kv_blocks_per_group) > 1:  # KV-cache groups: what each holds
            kv.update((f"group {g}", n) for g, n in enumerate(s.kv_blocks_per_group))
        if total:
            kv["total"] = total
        events.append({"name": "KV blocks", "ph": "C", "ts": ts, "pid": _ENGINE, "tid": 0,
                       "args": kv})
        events.append({"name": "batch", "ph": "C", "ts": ts, "pid": _ENGINE, "tid": 0,
                       "args": {"requests": s.num_requests, "prefill_tokens": s.num_prefill_tokens,
                                "decode_tokens": s.num_decode_tokens}})
        if speculative:  # every step, zero included: a counter holds its last value
            events.append({"name": "drafts", "ph": "C", "ts": ts, "pid": _ENGINE, "tid": 0,
                           "args": {"verified": s.num_draft_tokens,
                                    "accepted": s.num_accepted_drafts}})
