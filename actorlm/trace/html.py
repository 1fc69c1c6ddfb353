"""The self-contained HTML visualizer: one page, inline CSS and JS, no network.

``render_html(records)`` returns the page for a trace: one lane per request coloured by state
(waiting, running — prefill or decode —, preempted, finished with its reason) and labelled
with its prefix-cache hit, the steps with their batch composition and forward time (a mixture
of experts': how much of it the routers and the experts took), the KV cache's use over
time, summary figures (the cache-hit rate among them), filters, zoom, and hover details.
With speculative decoding, each verification is a mark on its request's lane (its height the
drafts, its dark part the accepted ones), the steps chart shows rejected drafts apart from
the decode tokens, and steps, segments and lanes say in their details how many drafts they
verified and accepted.
The data travels inside the page as JSON, its figures computed here; the script only lays
them out. Every lane carries ``data-request-id`` and ``data-cached-tokens``, every state
segment ``data-state`` (plus ``data-phase`` for running, ``data-reason`` for finished), a
request with a LoRA adapter ``data-lora`` (its label names the adapter too), each
summary figure ``data-figure``, a lane with drafts ``data-draft-tokens`` and
``data-accepted-tokens`` (its marks: ``data-verifications``), a step with drafts the same
two, and the page root gets ``data-rendered="true"`` once built, or ``data-js-errors`` if a
script failed — so tests and tools can check the page.
"""

from __future__ import annotations

import html
import json
from collections import Counter

from actorlm.trace.records import Record
from actorlm.trace.timeline import Timeline, build_timeline
from actorlm.trace.visualizer_assets import CSS, SCRIPT

MAX_LANES = 3000  # lanes drawn; the rest are counted (filters narrow the set)


def render_html(records: list[Record], title: str = "actorlm trace") -> str:
    """The visualizer page for ``records`` (a recorder's ``records()`` or a read trace)."""
    data = page_data(build_timeline(records), title)
    payload = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")
    return _PAGE.format(title=html.escape(title), css=CSS, data=payload, script=SCRIPT)


def page_data(timeline: Timeline, title: str) -> dict:
    t0 = timeline.t_min

    def ms(t: float) -> float:
        return round((t - t0) * 1e3, 3)

    config = timeline.config
    meta = {"title": title, "duration_ms": ms(timeline.t_max), "max_lanes": MAX_LANES}
    if config is not None:
        meta.update(model=config.model, max_num_batched_tokens=config.max_num_batched_tokens,
                    max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                    block_size=config.block_size, num_kv_blocks=config.num_kv_blocks,
                    enable_chunked_prefill=config.enable_chunked_prefill,
                    num_dropped=config.num_dropped, wall_time=config.wall_time,
                    num_speculative_tokens=config.num_speculative_tokens)
    lanes = []
    for lane in timeline.lanes:
        segments = [[s.state, ms(s.t_start), ms(s.t_end), s.step_start, s.step_end, s.phase,
                     s.num_tokens, s.num_steps, s.num_blocks, s.num_cached_tokens,
                     s.num_draft_tokens, s.num_accepted_tokens]
                    for s in lane.segments]
        stop = lane.stop_reason if isinstance(lane.stop_reason, (int, str)) else None
        lanes.append([lane.request_id, lane.num_prompt_tokens, lane.num_output_tokens,
                      lane.finish_reason, stop, lane.num_preemptions, lane.is_open, segments,
                      lane.num_cached_tokens, lane.num_draft_tokens, lane.num_accepted_tokens,
                      [[ms(step.t_start), ms(step.t_end), d, a]
                       for step, d, a in lane.verifications], lane.lora_name])
    steps = [[s.step, ms(s.t_start), ms(s.t_end), s.num_prefill_tokens, s.num_decode_tokens,
              s.kv_blocks_used, s.kv_blocks_free, s.num_running, s.num_waiting, s.request_ids,
              s.num_scheduled_tokens, s.preempted_ids, s.failed_ids, s.num_cached_tokens,
              s.kv_blocks_cached, s.kv_blocks_per_group, _ms_or_none(s.forward_s),
              _ms_or_none(s.router_s), _ms_or_none(s.experts_s),
              [len(d) for d in s.draft_token_ids], s.num_accepted_tokens]
             for s in timeline.steps]
    return {"meta": meta, "summary": summary_figures(timeline), "lanes": lanes, "steps": steps}


def _ms_or_none(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def summary_figures(timeline: Timeline) -> dict:
    """The figures atop the page; the cache-hit rate is a percentage (None: none admitted)."""
    lanes, steps = timeline.lanes, timeline.steps
    ran = [s for s in steps if s.request_ids]  # a plan that only returned blocks ran nothing
    rate = timeline.cache_hit_rate
    return {
        "by_reason": dict(Counter(lane.finish_reason for lane in lanes if lane.finish_reason)),
        "num_open": sum(lane.is_open for lane in lanes),
        "num_preempted": sum(lane.num_preemptions > 0 for lane in lanes),
        "num_preemptions": sum(lane.num_preemptions for lane in lanes),
        "num_prefill_tokens": sum(s.num_prefill_tokens for s in steps),
        "num_decode_tokens": sum(s.num_decode_tokens for s in steps),
        "max_step_tokens": max((s.num_prefill_tokens + s.num_decode_tokens for s in steps),
                               default=0),
        "peak_kv_blocks": max((s.kv_blocks_used for s in steps), default=0),
        # per KV-cache group (with more than one): a sliding group's stays near its window
        "peak_kv_blocks_per_group": [max(group) for group in zip(
            *(s.kv_blocks_per_group for s in steps if s.kv_blocks_per_group))],
        "kv_cache_windows": list(timeline.config.kv_cache_windows)
        if timeline.config is not None else [],
        "mean_step_ms": round(1e3 * sum(s.t_end - s.t_start for s in ran) / len(ran), 3)
        if ran else None,
        "cache_hit_rate": None if rate is None else round(100 * rate, 1),
        "num_cached_tokens": timeline.num_cached_tokens,
        "num_admitted_tokens": timeline.num_admitted_tokens,
        **_spec_figures(steps),
    }


def _spec_figures(steps) -> dict:
    """Speculative decoding's figures, as the engine's counters (``LLM.stats()``) have them;
    the rate is a percentage and both derived figures None without drafts."""
    drafted = sum(s.num_draft_tokens for s in steps)
    accepted = sum(s.num_accepted_drafts for s in steps)
    verifications = sum(s.num_verifications for s in steps)
    return {
        "num_draft_tokens": drafted, "num_accepted_drafts": accepted,
        "num_verifications": verifications,
        "draft_acceptance_rate": round(100 * accepted / drafted, 1) if drafted else None,
        # tokens a verification yields: the accepted drafts and the token drawn after them
        "mean_acceptance_length": round(1 + accepted / verifications, 2) if verifications
        else None,
    }


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{title}</title>
<style>{css}</style>
<script>
window.onerror = function (message, source, line) {{
  var root = document.documentElement;
  var seen = root.getAttribute('data-js-errors');
  root.setAttribute('data-js-errors',
                    (seen ? seen + ' | ' : '') + message + ' (line ' + line + ')');
}};
</script>
</head>
<body>
<div id="app"></div>
<div id="tip" hidden></div>
<script id="trace-data" type="application/json">{data}</script>
<script>{script}</script>
</body>
</html>
"""
