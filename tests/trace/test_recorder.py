"""What the recorder writes: the configuration first, arrivals, transitions, messages, steps."""

import json

import pytest

from actorlm.api.cli import main
from actorlm.config import EngineConfig
from actorlm.core.scheduler import SchedulerConfig
from actorlm.messages import AddRequest
from actorlm.sampling_params import SamplingParams
from actorlm.trace import (Abort, Arrival, MessageSent, StateChange, StepSummary, Stop,
                           TraceConfig, TraceRecorder, parse_lines, replay_trace)
from actorlm.trace.replay import SyncEngine, TraceIncomplete


def test_the_first_record_holds_what_replay_needs(tiny_run):
    config = tiny_run.records[0]
    assert isinstance(config, TraceConfig)
    assert (config.max_num_batched_tokens, config.max_num_seqs, config.max_model_len,
            config.block_size, config.num_kv_blocks, config.enable_chunked_prefill) == \
        (48, 6, 96, 4, 24, True)
    assert config.eos_token_ids and config.num_dropped == 0
    first_line = json.loads(tiny_run.path.read_text().splitlines()[0])
    assert first_line["kind"] == "config" and first_line["block_size"] == 4
    assert not any(isinstance(r, TraceConfig) for r in tiny_run.records[1:])


def test_every_request_step_and_message_is_recorded(tiny_run):
    records, stats = tiny_run.records, tiny_run.stats
    arrivals = [r for r in records if isinstance(r, Arrival)]
    assert len(arrivals) == 28  # 16 probes, the victim, 11 prompts of the second call
    forked = next(a for a in arrivals if a.n == 2)
    assert forked.max_tokens is not None and forked.stop_token_ids == []
    changes = [r for r in records if isinstance(r, StateChange)]
    finished = {c.request_id: c for c in changes if c.target == "finished"}
    assert len(finished) == stats["num_finished"] == 29  # the n = 2 request runs as 2
    assert sum(c.event == "preempt" for c in changes) == stats["num_preemptions"] > 0
    assert finished["victim"].reason == "abort"
    assert any(c.reason == "stop" and c.stop_reason == tiny_run.stop for c in changes)
    assert any(isinstance(r, Abort) and r.request_ids == ["victim"] for r in records)
    assert any(isinstance(r, Stop) and r.stop_reasons == [tiny_run.stop] for r in records)

    steps = [r for r in records if isinstance(r, StepSummary)]
    assert [s.step for s in steps] == list(range(len(steps)))  # every plan, none twice
    ran = [s for s in steps if s.request_ids]
    assert len(ran) == stats["num_steps"]
    assert sum(s.num_prefill_tokens + s.num_decode_tokens for s in ran) == \
        stats["num_scheduled_tokens"]
    assert {rid for s in steps for rid in s.preempted_ids}
    for s in ran:
        assert s.kv_blocks_used + s.kv_blocks_free == 24 and s.kv_blocks_cached <= s.kv_blocks_free
        assert s.t_end >= s.t_start and s.duration_s == pytest.approx(s.t_end - s.t_start)
        assert sum(s.num_scheduled_tokens) <= 48 and len(s.request_ids) <= 6

    messages = [r for r in records if isinstance(r, MessageSent)]
    kinds = {(m.type, m.sender, m.receiver) for m in messages}
    assert {("AddRequest", "frontend", "scheduler"), ("AllocateSlots", "scheduler", "allocator"),
            ("SlotsGranted", "allocator", "scheduler"), ("ScheduleStep", "scheduler", "executor"),
            ("StepResult", "executor", "scheduler"), ("EngineOutputs", "scheduler", "frontend"),
            ("AbortRequests", "frontend", "scheduler"),
            ("StopRequests", "frontend", "scheduler")} <= kinds
    step_messages = [m for m in messages if m.type == "ScheduleStep"]
    assert len(step_messages) == stats["num_steps"] and all(m.num_bytes > 0 for m in step_messages)


def test_the_file_is_complete_when_generate_returns(tiny_run):
    steps = [r for r in tiny_run.at_return if isinstance(r, StepSummary)]
    assert [s.step for s in steps] == list(range(len(steps)))
    assert sum(1 for s in steps if s.request_ids) == tiny_run.stats["num_steps"]
    assert not steps[-1].request_ids  # the plan that returned the last blocks is in
    finished = {r.request_id for r in tiny_run.at_return
                if isinstance(r, StateChange) and r.target == "finished"}
    assert len(finished) == tiny_run.stats["num_finished"]


def test_trace_file_is_not_an_engine_flag():
    with pytest.raises(ValueError, match="unknown engine flag"):
        EngineConfig.from_flags(None, trace_file="x.jsonl")
    with pytest.raises(SystemExit):
        main(["generate", "--trace-file", "x.jsonl", "hi"])


def _add(engine: SyncEngine, index: int) -> None:
    engine.send(AddRequest(f"r{index}", [3 + index % 5] * (4 + index % 9),
                           SamplingParams(max_tokens=2 + index % 4, temperature=0.0), 0, 0.0))


def test_the_ring_buffer_stays_bounded_over_10000_requests():
    capacity = 5000
    recorder = TraceRecorder(capacity=capacity)
    engine = SyncEngine(SchedulerConfig(256, 64, 64, 4, True, frozenset()), 256,
                        recorder=recorder, check_kv=False)
    for i in range(10_000):
        _add(engine, i)
        if i % 16 == 15 and engine.held is not None:
            engine.deliver_held()
        if i == 4_999:
            assert len(recorder._records) == capacity
    engine.run_until_idle()
    assert engine.scheduler.num_finished == 10_000
    assert len(recorder._records) == capacity
    assert recorder.num_recorded > 5 * capacity
    records = recorder.records()
    assert len(records) == capacity + 1 and isinstance(records[0], TraceConfig)
    assert records[0].num_dropped == recorder.num_dropped == recorder.num_recorded - capacity
    lines = recorder.jsonl_lines()
    assert len(lines) == capacity + 1 and parse_lines(lines)[0] == records[0]
    with pytest.raises(TraceIncomplete, match="dropped"):
        replay_trace(records)


def test_a_trace_file_holds_the_whole_run_beyond_the_ring_buffer(tmp_path):
    path = tmp_path / "run.jsonl"
    recorder = TraceRecorder(capacity=100, path=path)
    engine = SyncEngine(SchedulerConfig(64, 8, 64, 4, True, frozenset()), 64, recorder=recorder)
    for i in range(60):
        _add(engine, i)
    engine.run_until_idle()
    recorder.close()
    lines = path.read_text().splitlines()
    assert len(lines) == recorder.num_recorded + 1  # the configuration, then every record
    records = parse_lines(lines)
    assert records[0].capacity == 0 and records[0].num_dropped == 0
    assert replay_trace(records).matched


def test_a_forwarding_recorder_hands_every_record_on_and_keeps_none():
    """An engine core's recorder: its records go to the frontend's ring, once each, in order;
    a second ring in the core would only grow its memory."""
    core, frontend = TraceRecorder(capacity=5000), TraceRecorder(capacity=5000)
    engine = SyncEngine(SchedulerConfig(64, 8, 64, 4, True, frozenset()), 64, recorder=core)
    core.forward()
    for i in range(40):
        _add(engine, i)
        if i % 8 == 7:
            frontend.ingest(core.take_new())
    engine.run_until_idle()
    frontend.ingest(core.take_new())
    assert core.take_new() == [] and len(core._records) == 0
    records = frontend.records()
    assert len(records) == core.num_recorded + 1
    assert replay_trace(records).matched
