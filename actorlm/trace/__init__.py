"""Trace recorder, Chrome/Perfetto export, HTML visualizer and replay (docs/architecture.md).

Record a run with ``LLM(..., trace_file=PATH)`` (or ``EngineSystem(..., trace=TraceRecorder())``),
then ``actorlm trace render|perfetto|replay PATH``.
"""

from actorlm.trace.html import render_html
from actorlm.trace.perfetto import to_perfetto, write_perfetto
from actorlm.trace.recorder import TraceRecorder, TracedRef
from actorlm.trace.records import (Abort, Arrival, MessageSent, Record, StateChange,
                                   StepSummary, Stop, TraceConfig, parse_lines, read_jsonl,
                                   write_jsonl)
from actorlm.trace.timeline import build_timeline

__all__ = ["TraceRecorder", "TracedRef", "render_html", "to_perfetto", "write_perfetto",
           "build_timeline", "read_jsonl", "write_jsonl", "parse_lines", "Record", "TraceConfig",
           "Arrival", "Abort", "Stop", "StateChange", "MessageSent", "StepSummary",
           "replay_trace"]


def replay_trace(records, **kwargs):
    """See ``actorlm.trace.replay.replay_trace`` (imported lazily: it pulls in the actors)."""
    from actorlm.trace.replay import replay_trace as _replay

    return _replay(records, **kwargs)
