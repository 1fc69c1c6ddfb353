"""``actorlm trace render | perfetto | replay``: what the command line does with a trace file."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_trace_commands(commands) -> None:
    """Register ``trace`` and its subcommands on the ``actorlm`` command's subparsers."""
    trace = commands.add_parser("trace", help="render, export or replay a recorded trace")
    sub = trace.add_subparsers(dest="trace_command", required=True)
    render = sub.add_parser("render", help="the self-contained HTML visualizer")
    render.add_argument("trace_file", metavar="TRACE.jsonl")
    render.add_argument("-o", "--output", required=True, metavar="OUT.html")
    render.add_argument("--title", default=None)
    render.set_defaults(run=_render)
    perfetto = sub.add_parser("perfetto", help="Chrome/Perfetto trace-event JSON")
    perfetto.add_argument("trace_file", metavar="TRACE.jsonl")
    perfetto.add_argument("-o", "--output", required=True, metavar="OUT.json")
    perfetto.set_defaults(run=_perfetto)
    replay = sub.add_parser("replay", help="re-run the recorded schedule with a fake model and "
                                           "compare every step (exit 0: identical, 1: diverged)")
    replay.add_argument("trace_file", metavar="TRACE.jsonl")
    replay.add_argument("-o", "--output", default=None, metavar="REPLAY.jsonl",
                        help="also write the replay's own trace")
    replay.set_defaults(run=_replay)


def _read(path: str):
    from actorlm.trace.records import read_jsonl

    if not Path(path).is_file():
        raise ValueError(f"{path}: no such trace file")
    return read_jsonl(path)


def _render(args: argparse.Namespace) -> int:
    from actorlm.trace.html import render_html

    records = _read(args.trace_file)
    title = args.title or f"actorlm trace · {Path(args.trace_file).name}"
    Path(args.output).write_text(render_html(records, title), encoding="utf-8")
    print(f"wrote {args.output} ({len(records)} records)")
    return 0


def _perfetto(args: argparse.Namespace) -> int:
    from actorlm.trace.perfetto import write_perfetto

    records = _read(args.trace_file)
    write_perfetto(records, args.output)
    print(f"wrote {args.output}: open it in https://ui.perfetto.dev or chrome://tracing")
    return 0


def _replay(args: argparse.Namespace) -> int:
    from actorlm.trace.records import write_jsonl
    from actorlm.trace.replay import replay_trace

    report = replay_trace(_read(args.trace_file))
    if args.output:
        write_jsonl(args.output, report.replayed)
    print(report.describe(), file=sys.stdout)
    return 0 if report.matched else 1
