"""The Perfetto export validates as trace-event JSON; the HTML page renders in a real browser."""

import json
import subprocess
from collections import Counter, defaultdict
from html.parser import HTMLParser

from actorlm.api.cli import main
from actorlm.trace import Arrival, build_timeline, render_html, to_perfetto
from actorlm.trace.html import summary_figures
from actorlm.trace.records import StateChange, StepSummary, TraceConfig

_REQUIRED = {"X": {"name", "ts", "dur", "pid", "tid"}, "i": {"name", "ts", "pid", "tid", "s"},
             "C": {"name", "ts", "pid", "args"}, "M": {"name", "pid", "args"}}


def test_perfetto_export_is_valid_trace_event_json(tiny_run, tmp_path):
    out = tmp_path / "trace.json"
    assert main(["trace", "perfetto", str(tiny_run.path), "-o", str(out)]) == 0
    trace = json.loads(out.read_text())
    assert trace == json.loads(json.dumps(to_perfetto(tiny_run.records)))
    events = trace["traceEvents"]
    last_ts: dict[tuple, float] = {}
    for e in events:
        assert e["ph"] in _REQUIRED, e
        assert _REQUIRED[e["ph"]] <= e.keys(), e
        if e["ph"] == "M":
            continue
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
        track = (e["pid"], e.get("tid", 0), e["ph"] == "C" and e["name"])
        assert e["ts"] >= last_ts.get(track, 0), f"timestamps go back on track {track}"
        last_ts[track] = e["ts"]
        if e["ph"] == "X":
            assert e["dur"] >= 0
        if e["ph"] == "i":
            assert e["s"] in ("g", "p", "t")
        if e["ph"] == "C":
            assert e["args"] and all(isinstance(v, (int, float)) for v in e["args"].values())

    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    request_tracks = [n for n in names.values() if n.startswith("request ")]
    assert len(request_tracks) == tiny_run.stats["num_finished"]
    assert {"frontend", "scheduler", "allocator", "executor"} <= set(names.values())
    span_names = Counter(e["name"] for e in events if e["ph"] == "X")
    assert span_names["waiting"] and span_names["running"] and span_names["preempted"]
    assert span_names["prefill"] and span_names["decode"]
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert {"KV blocks", "batch"} <= counters
    # the one worker rank has a track of its own, with every step's forward on it
    assert "rank 0" in names.values()
    forwards = [e for e in events if e["ph"] == "X" and e["cat"] == "rank" and e["name"] == "forward"]
    assert len(forwards) == sum(1 for r in tiny_run.records
                                if isinstance(r, StepSummary) and r.rank_timings)
    # a request's state spans never overlap: each starts where the previous one ended
    spans = defaultdict(list)
    for e in events:
        if e["ph"] == "X" and e["pid"] == 1 and e["name"] in ("waiting", "running", "preempted"):
            spans[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for tid, items in spans.items():
        for (_, end), (start, _) in zip(items, items[1:]):
            assert start >= end - 1e-3, f"overlapping state spans on request track {tid}"


def test_lanes_are_contiguous_and_end_as_recorded(tiny_run):
    timeline = build_timeline(tiny_run.records)
    assert len(timeline.lanes) == tiny_run.stats["num_finished"]
    for lane in timeline.lanes:
        segments = lane.segments
        assert segments[0].state == "waiting" and segments[-1].state == "finished"
        for a, b in zip(segments, segments[1:]):
            assert b.t_start == a.t_end and b.t_start >= a.t_start
        assert lane.finish_reason in ("stop", "length", "abort")
    reasons = Counter(lane.finish_reason for lane in timeline.lanes)
    assert reasons["abort"] == 1 and reasons["stop"] >= 1


class _Dom(HTMLParser):
    _VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta",
             "source", "track", "wbr"}

    def __init__(self):
        super().__init__()
        self.root: dict = {}
        self.lanes: list[str] = []
        self.states: Counter = Counter()
        self.phases: Counter = Counter()
        self.cached: dict[str, str] = {}  # request id -> its lane's data-cached-tokens
        self.text: defaultdict[str, str] = defaultdict(str)  # "lane:<id>" / "figure:<name>"
        self._owners: list[str | None] = []  # per open element: whose text it holds

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "html":
            self.root = attrs
        owner = self._owners[-1] if self._owners else None
        if "data-request-id" in attrs:
            self.lanes.append(attrs["data-request-id"])
            self.cached[attrs["data-request-id"]] = attrs.get("data-cached-tokens")
            owner = "lane:" + attrs["data-request-id"]
        if "data-figure" in attrs:
            owner = "figure:" + attrs["data-figure"]
        if "data-state" in attrs:
            self.states[attrs["data-state"]] += 1
        if "data-phase" in attrs:
            self.phases[attrs["data-phase"]] += 1
        if tag not in self._VOID:
            self._owners.append(owner)

    def handle_endtag(self, tag):
        if tag not in self._VOID and self._owners:
            self._owners.pop()

    def handle_data(self, data):
        if self._owners and self._owners[-1] is not None:
            self.text[self._owners[-1]] += data


def _headless(chromium: str, tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
         "--enable-logging=stderr", "--v=0", *args],
        capture_output=True, text=True, timeout=120)


def test_html_visualizer_renders_in_headless_chromium(tiny_run, chromium, tmp_path):
    page = tmp_path / "trace.html"
    assert main(["trace", "render", str(tiny_run.path), "-o", str(page)]) == 0
    html = page.read_text()
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in html and "<link" not in html and " src=" not in html
    done = _headless(chromium, tmp_path, "--dump-dom", page.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Uncaught" not in done.stderr, done.stderr[-2000:]
    dom = _Dom()
    dom.feed(done.stdout)
    assert "data-js-errors" not in dom.root, dom.root.get("data-js-errors")
    assert dom.root.get("data-rendered") == "true"
    engine_ids = {lane.request_id for lane in build_timeline(tiny_run.records).lanes}
    assert sorted(dom.lanes) == sorted(engine_ids) and len(dom.lanes) == len(engine_ids)
    forked = next(r.request_id for r in tiny_run.records if isinstance(r, Arrival) and r.n == 2)
    assert {"victim", f"0_{forked}", f"1_{forked}"} <= set(dom.lanes)  # aborted; the n = 2 pair
    assert dom.states["waiting"] and dom.states["running"] and dom.states["preempted"]
    assert dom.states["finished"] == len(engine_ids)
    assert dom.phases["prefill"] and dom.phases["decode"]
    assert dom.text["figure:cache-hit-rate"].endswith("%cache hit rate")


def _page_data(page: str) -> dict:
    start = page.index('<script id="trace-data" type="application/json">')
    body = page[page.index(">", start) + 1:page.index("</script>", start)]
    return json.loads(body)


def test_render_html_copes_with_an_empty_or_partial_trace(tiny_run):
    empty = _page_data(render_html(tiny_run.records[:1]))  # the configuration alone
    assert empty["lanes"] == [] and empty["steps"] == [] and empty["meta"]["num_kv_blocks"] == 24
    half = _page_data(render_html(tiny_run.records[: len(tiny_run.records) // 2]))
    assert half["lanes"] and half["steps"]
    assert any(lane[6] for lane in half["lanes"])  # requests still live when the trace ends


def _cache_hit_trace() -> list:
    """Three requests: "a" finds 96 of its 128 prompt tokens cached, "b" nothing, "c" nothing
    at first, then 32 of its 40 tokens when re-admitted after a preemption. Hit rate:
    (96 + 32) / (128 + 64 + 32 + 40) = 48.5 %."""
    config = TraceConfig(128, 4, 256, 16, 32, True, [2], model="synthetic")
    prompts = {"a": 128, "b": 64, "c": 32}
    records = [config, *(Arrival(0.0, 0, rid, n, 1, 16, 0, True, []) for rid, n in prompts.items())]

    def change(t, step, rid, source, target, event, out=0, cached=0, reason=None):
        return StateChange(t, step, rid, source, target, event, reason, prompts[rid], out,
                           cached, 0, num_cached_tokens=cached)

    def step(k, ids, tokens, prefill, cached=0, preempted=()):
        return StepSummary(k, 0.01 * k + 0.01, 0.01 * k + 0.018, 0.008, ids, tokens, prefill,
                           sum(n for n, p in zip(tokens, prefill) if p),
                           sum(n for n, p in zip(tokens, prefill) if not p), list(preempted),
                           [], 8, 24, 2, len(ids), 0, num_cached_tokens=cached)

    records += [change(0.01, 0, "a", "waiting", "running", "schedule", cached=96),
                change(0.01, 0, "b", "waiting", "running", "schedule"),
                change(0.01, 0, "c", "waiting", "running", "schedule"),
                step(0, ["a", "b", "c"], [32, 64, 32], [True] * 3, cached=96),
                step(1, ["a", "b", "c"], [1, 1, 1], [False] * 3),
                change(0.029, 2, "c", "running", "preempted", "preempt", out=8),
                step(2, ["a", "b"], [1, 1], [False] * 2, preempted=["c"]),
                change(0.039, 3, "c", "preempted", "running", "schedule", out=8, cached=32),
                step(3, ["a", "b", "c"], [1, 1, 8], [False, False, True], cached=32)]
    records += [change(0.05, 4, rid, "running", "finished", "finish", out=16, reason="length")
                for rid in "abc"]
    return records


def test_cache_hits_reach_lanes_summary_and_perfetto():
    records = _cache_hit_trace()
    timeline = build_timeline(records)
    lanes = {lane.request_id: lane for lane in timeline.lanes}
    # a lane shows its first admission's hit; the re-admission's stays on its own segment
    assert {rid: lane.num_cached_tokens for rid, lane in lanes.items()} == {"a": 96, "b": 0, "c": 0}
    assert [s.num_cached_tokens for s in lanes["c"].segments if s.state == "running"][-1] == 32
    assert (timeline.num_cached_tokens, timeline.num_admitted_tokens) == (128, 264)
    assert summary_figures(timeline)["cache_hit_rate"] == 48.5
    trace = to_perfetto(records)
    assert trace["otherData"]["cache_hit_rate"] == round(128 / 264, 4)
    running = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"] == "running"]
    assert sorted(e["args"]["num_cached_tokens"] for e in running) == [0, 0, 32, 96]
    steps = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] == "step"]
    assert [e["args"]["num_cached_tokens"] for e in steps] == [96, 0, 0, 32]
    assert summary_figures(build_timeline(records[:1]))["cache_hit_rate"] is None


def test_html_labels_lanes_with_their_cache_hits_and_shows_the_hit_rate(chromium, tmp_path):
    page = tmp_path / "cache.html"
    page.write_text(render_html(_cache_hit_trace()))
    done = _headless(chromium, tmp_path, "--dump-dom", page.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = _Dom()
    dom.feed(done.stdout)
    assert "data-js-errors" not in dom.root, dom.root.get("data-js-errors")
    assert dom.root.get("data-rendered") == "true"
    assert dom.cached == {"a": "96", "b": "0", "c": "0"}
    assert "128\u219216 \u00b7 96 cached" in dom.text["lane:a"]
    assert "cached" not in dom.text["lane:b"] and "cached" not in dom.text["lane:c"]
    assert dom.text["figure:cache-hit-rate"] == "48.5%cache hit rate"
    assert dom.text["figure:preemptions"] == "1 / 1preempted reqs / times"


def test_each_rank_gets_a_track_ending_with_its_step():
    config = TraceConfig(128, 4, 256, 16, 32, True, [2], model="synthetic")
    timings = [[0.001, 0.004, 0.002], [0.001, 0.005, 0.0]]  # rank 1 does not sample
    step = StepSummary(0, 1.0, 1.01, 0.01, ["a"], [4], [True], 4, 0, [], [], 1, 31, 0, 1, 0,
                       prepare_s=0.001, forward_s=0.004, sample_s=0.002, rank_timings=timings)
    trace = to_perfetto([config, Arrival(0.99, 0, "a", 4, 1, 16, 0, True, []), step])
    events = trace["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events
              if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 3}
    for rank, phases in enumerate(timings):
        tid = next(t for t, name in tracks.items() if name == f"rank {rank}")
        spans = [e for e in events if e["ph"] == "X" and e["tid"] == tid and e["cat"] == "rank"]
        assert [e["name"] for e in spans] == ["prepare", "forward", "sample"]
        assert [e["dur"] for e in spans] == [round(p * 1e6, 3) for p in phases]
        assert abs(spans[-1]["ts"] + spans[-1]["dur"] - 20_000) < 1  # the step's end, in us


def test_html_shows_the_peak_blocks_of_each_kv_cache_group(chromium, tmp_path):
    from actorlm.testing import EngineHarness
    from actorlm.trace import TraceRecorder

    recorder = TraceRecorder()
    with EngineHarness(trace=recorder, kv_cache_windows=(None, 8), num_kv_blocks=64,
                       block_size=4, max_model_len=64) as h:
        h.add_request(list(range(5, 25)), max_tokens=30, ignore_eos=True)  # 50 tokens: 13 blocks
        h.run_until_idle()
    page = tmp_path / "groups.html"
    page.write_text(render_html(recorder.records()))
    done = _headless(chromium, tmp_path, "--dump-dom", page.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = _Dom()
    dom.feed(done.stdout)
    assert "data-js-errors" not in dom.root, dom.root.get("data-js-errors")
    # the full group ends holding all 13; the sliding one peaks at the prompt's 5 (its
    # prefill reads them all), then holds its window's 3
    assert dom.text["figure:peak-kv-groups"] == \
        "13 / 5peak blocks per KV-cache group (full / window 8)"
