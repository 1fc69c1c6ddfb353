"""A mixture-of-experts step's router and experts seconds in the trace: they cross the
worker wire in ``StepResult`` and the JSON lines in ``StepSummary`` unchanged (an older line
without them reads as unmeasured), and the Perfetto export and the HTML page show them with
the step's forward."""

import msgspec

from actorlm.executors.wire import WireCodec, WorkerReply
from actorlm.messages import StepResult
from actorlm.trace import Arrival, build_timeline, to_perfetto
from actorlm.trace.html import page_data
from actorlm.trace.records import StepSummary, TraceConfig, encode_line, parse_lines

CONFIG = TraceConfig(128, 4, 256, 16, 32, True, [2], model="synthetic")
ARRIVAL = Arrival(0.99, 0, "a", 4, 1, 16, 0, True, [])


def _step(router_s=None, experts_s=None) -> StepSummary:
    return StepSummary(0, 1.0, 1.01, 0.01, ["a"], [4], [True], 4, 0, [], [], 1, 31, 0, 1, 0,
                       prepare_s=0.001, forward_s=0.004, sample_s=0.002,
                       rank_timings=[[0.001, 0.004, 0.002], [0.001, 0.005, 0.0]],
                       router_s=router_s, experts_s=experts_s)


def test_the_figures_cross_the_worker_wire_and_the_trace_file_unchanged():
    result = StepResult(4, ["a"], [11], timings=[0.001, 0.004, 0.002], router_s=0.0005,
                        experts_s=0.002)
    codec = WireCodec()
    assert codec.decode_reply(codec.encode_reply(WorkerReply(result=result))).result == result
    step = _step(0.0005, 0.002)
    assert parse_lines([encode_line(step)]) == [step]
    # a line written before the fields existed: not measured
    older = msgspec.json.decode(encode_line(step))
    del older["router_s"], older["experts_s"]
    (read,) = parse_lines([msgspec.json.encode(older)])
    assert read.router_s is None and read.experts_s is None


def test_perfetto_nests_router_and_experts_in_rank_0s_forward():
    events = to_perfetto([CONFIG, ARRIVAL, _step(0.0005, 0.002)])["traceEvents"]
    (forward,) = [e for e in events if e.get("cat") == "rank" and e["name"] == "forward"
                  and e["tid"] == 2]  # rank 0's track
    router, experts = [e for e in events if e.get("cat") == "moe"]
    assert (router["name"], experts["name"]) == ("router", "experts")
    assert router["tid"] == experts["tid"] == forward["tid"]
    assert (router["dur"], experts["dur"]) == (500.0, 2000.0)
    assert router["ts"] == forward["ts"] and experts["ts"] == router["ts"] + router["dur"]
    assert experts["ts"] + experts["dur"] <= forward["ts"] + forward["dur"]
    dense = to_perfetto([CONFIG, ARRIVAL, _step()])["traceEvents"]
    assert not [e for e in dense if e.get("cat") == "moe"]


def test_the_html_page_carries_each_steps_forward_router_and_experts_ms():
    (moe,) = page_data(build_timeline([CONFIG, ARRIVAL, _step(0.0005, 0.002)]), "t")["steps"]
    assert moe[16:19] == [4.0, 0.5, 2.0]
    (dense,) = page_data(build_timeline([CONFIG, ARRIVAL, _step()]), "t")["steps"]
    assert dense[16:19] == [4.0, None, None]
