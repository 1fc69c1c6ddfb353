"""Replay re-drives the real scheduler and allocator and finds the first step that differs."""

import queue
import random
import re
from types import SimpleNamespace

import msgspec

from actorlm.actors.system import EngineSystem
from actorlm.api.cli import main
from actorlm.config import EngineConfig
from actorlm.messages import AbortRequests, SubmitRequest
from actorlm.models.parts import ModelParts
from actorlm.sampling_params import SamplingParams
from actorlm.testing import FakeModelRunner, ToyTokenizer
from actorlm.trace import (Abort, Arrival, StateChange, StepSummary, Stop, TraceRecorder,
                           replay_trace, write_jsonl)


def test_replay_of_a_real_run_matches_every_step(tiny_run, capsys):
    assert main(["trace", "replay", str(tiny_run.path)]) == 0
    out = capsys.readouterr().out
    num_steps = sum(isinstance(r, StepSummary) for r in tiny_run.records)
    assert f"replay matches: {num_steps} steps" in out
    report = replay_trace(tiny_run.records)
    assert report.matched and report.num_steps == num_steps
    replayed = [r for r in report.replayed if isinstance(r, StepSummary)]
    recorded = [r for r in tiny_run.records if isinstance(r, StepSummary)]
    assert [(s.request_ids, s.num_scheduled_tokens, s.preempted_ids) for s in replayed] == \
        [(s.request_ids, s.num_scheduled_tokens, s.preempted_ids) for s in recorded]
    # the run had what makes a replay hard: preemptions, an abort, a stop string, n = 2
    assert any(s.preempted_ids for s in recorded)
    assert any(isinstance(r, Abort) for r in tiny_run.records)
    assert any(isinstance(r, Stop) for r in tiny_run.records)


def test_replay_of_an_edited_recording_reports_the_first_divergent_step(tiny_run, tmp_path,
                                                                        capsys):
    records = list(tiny_run.records)
    steps = [r for r in records if isinstance(r, StepSummary)]
    arrival = [r for r in records if isinstance(r, Arrival)][-1]  # the last of a burst: it waits
    first_run = next(s.step for s in steps if arrival.request_id in s.request_ids)
    later = first_run + 2
    # move the arrival after step `later`'s result, where the scheduler's next plan is later + 2
    records.remove(arrival)
    at = next(i for i, r in enumerate(records) if isinstance(r, StepSummary) and r.step == later)
    records.insert(at + 1, msgspec.structs.replace(arrival, step=later + 2))
    edited = tmp_path / "edited.jsonl"
    write_jsonl(edited, records)

    assert main(["trace", "replay", str(edited)]) == 1
    out = capsys.readouterr().out
    match = re.search(r"first divergent step: (\d+)", out)
    assert match, out
    step = int(match.group(1))
    assert arrival.step <= step <= first_run
    assert "recorded:" in out and "replayed:" in out
    report = replay_trace(records)
    assert not report.matched and report.divergence.step == step


def _fake_engine(recorder: TraceRecorder, runner: FakeModelRunner, eos: int) -> EngineSystem:
    flags = dict(num_kv_blocks=24, block_size=4, max_model_len=64, max_num_batched_tokens=32,
                 max_num_seqs=6)
    config = EngineConfig.from_flags(None, **flags).resolve(
        SimpleNamespace(max_position_embeddings=64), kv_bytes_per_block=1)
    parts = ModelParts("fake", ToyTokenizer(runner.vocab_size, eos), lambda rank: runner,
                       runner.vocab_size, frozenset({eos}))
    return EngineSystem(config, parts=parts, trace=recorder)


def test_replay_matches_a_fake_model_run_with_every_kind_of_ending():
    """EOS, stop tokens, stop strings, length caps, n = 2, aborts, runner faults and prefix-cache
    hits, all in one free-running (threaded) engine; the replay reproduces every step."""
    eos, rng = 3, random.Random(11)
    runner = FakeModelRunner(vocab_size=40, block_size=4, num_blocks=24, first_token_id=0)
    recorder = TraceRecorder()
    system = _fake_engine(recorder, runner, eos)
    sink: queue.Queue = queue.Queue()
    ids = []
    try:
        system_prompt = [rng.randrange(4, 40) for _ in range(9)]  # shared by half of them
        for i in range(24):
            prompt = (system_prompt if i % 2 else []) + \
                [rng.randrange(4, 40) for _ in range(rng.randrange(2, 20))]
            params = dict(max_tokens=rng.randrange(4, 30), temperature=0.0)
            if i % 5 == 1:
                params["stop_token_ids"] = [runner.token_at(prompt, len(prompt) + 3)]
            if i % 5 == 2:  # the ToyTokenizer writes token t as " t<t>"
                params["stop"] = [f" t{runner.token_at(prompt, len(prompt) + 2)} "]
            if i % 7 == 3:
                params["n"] = 2
            if i % 6 == 4:
                params["ignore_eos"] = True
            request_id = f"q{i}"
            if i == 9:
                runner.fail_request("q9")
            system.frontend.ask(SubmitRequest(request_id, prompt, SamplingParams(**params), sink))
            ids.append(request_id)
            if i in (5, 17):
                system.frontend.tell(AbortRequests([request_id]))
        finished = {}
        while len(finished) < len(ids):
            output = sink.get(timeout=60)
            finished[output.request_id] = output
        system.kv_stats(), system.scheduler_stats()  # let the last free reach the trace
    finally:
        system.stop()
    records = recorder.records()
    reasons = {c.reason for c in records if isinstance(c, StateChange) and c.reason}
    assert {"stop", "length", "abort", "error"} <= reasons
    assert any(isinstance(c, StateChange) and isinstance(c.stop_reason, int) for c in records)
    assert any(isinstance(r, Stop) for r in records)
    assert any(isinstance(r, StepSummary) and r.failed_ids for r in records)
    assert any(isinstance(r, StepSummary) and r.preempted_ids for r in records)
    assert sum(r.num_cached_tokens for r in records if isinstance(r, StepSummary)) >= 8 * 5
    report = replay_trace(records)
    assert report.matched, report.describe()


def test_replay_of_a_run_with_kv_cache_groups_matches_every_groups_blocks():
    from actorlm.testing import EngineHarness

    recorder = TraceRecorder()
    with EngineHarness(trace=recorder, kv_cache_windows=(None, 8), num_kv_blocks=1 + 30,
                       block_size=4, max_model_len=64, max_num_batched_tokens=16) as h:
        shared = [5 + (7 * i) % 90 for i in range(13)]
        for i in range(4):
            h.add_request(shared + [50 + i] * (1 + i), max_tokens=30, ignore_eos=True)
        h.run_until_idle()
        h.check_invariants()
    records = recorder.records()
    assert records[0].kv_cache_windows == [None, 8]
    steps = [r for r in records if isinstance(r, StepSummary)]
    assert any(s.preempted_ids for s in steps)
    assert all(len(s.kv_blocks_per_group) == 2 and
               sum(s.kv_blocks_per_group) == s.kv_blocks_used for s in steps)
    # the sliding group lets go of what its window left: the full group holds more
    assert max(s.kv_blocks_per_group[0] - s.kv_blocks_per_group[1] for s in steps) > 4
    report = replay_trace(records)
    assert report.matched, report.describe()
    # a pool of one full group would hold other blocks: the replay notices
    one_group = [msgspec.structs.replace(records[0], kv_cache_windows=[]), *records[1:]]
    assert not replay_trace(one_group).matched


def test_replay_of_a_priority_run_follows_the_recorded_policy():
    from actorlm.testing import EngineHarness

    recorder = TraceRecorder()
    with EngineHarness(trace=recorder, num_kv_blocks=12, block_size=4, max_model_len=48,
                       max_num_batched_tokens=16, scheduling_policy="priority") as h:
        for i in range(6):
            h.add_request([5 + (11 * i + j) % 90 for j in range(6 + i)], max_tokens=20,
                          ignore_eos=True, priority=(-i) % 3)
        h.run_until_idle()
        h.check_invariants()
    records = recorder.records()
    assert records[0].scheduling_policy == "priority"
    assert [r.priority for r in records if isinstance(r, Arrival)] == [0, 2, 1, 0, 2, 1]
    assert any(s.preempted_ids for s in records if isinstance(s, StepSummary))
    report = replay_trace(records)
    assert report.matched, report.describe()
    # the same arrivals first come, first served schedule otherwise: the replay notices
    as_fcfs = [msgspec.structs.replace(records[0], scheduling_policy="fcfs"), *records[1:]]
    assert not replay_trace(as_fcfs).matched
