"""A run with speculative decoding: its trace records each step's drafts and how many were
accepted, as the engine counted them; the timeline, the Perfetto export and the page show them;
the replay reproduces every verification."""

import random
from types import SimpleNamespace

import msgspec
import pytest
from spec_proposers import KnowingProposer
from test_exports import _Dom, _headless, _page_data

import actorlm.models.parts
from actorlm import LLM, SamplingParams
from actorlm.trace import build_timeline, read_jsonl, render_html, replay_trace, to_perfetto
from actorlm.trace.html import summary_figures
from actorlm.trace.records import StepSummary

K = 3


@pytest.fixture(scope="module")
def spec_run(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama under KV pressure (preemptions) with drafts that are right up to one
    spoiled token; one request ends on a stop token, others at max_tokens."""
    rng = random.Random(5)
    passages = [[rng.randrange(3, 200) for _ in range(n)] for n in (14, 22, 31, 9, 26, 17)]
    prompts = [p + p[:len(p) // 2] for p in passages]
    flags = dict(dtype="float32", num_kv_blocks=36, block_size=4, max_model_len=128,
                 max_num_batched_tokens=48, max_num_seqs=6)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_llama_dir), **flags) as llm:
        free = [list(o.outputs[0].token_ids) for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    stop_token = free[1][20]  # inside a run of accepted drafts, most likely
    all_params = [params] * len(prompts)
    all_params[1] = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True,
                                   stop_token_ids=[stop_token])
    path = tmp_path_factory.mktemp("spec") / "spec_run.jsonl"
    answers = [p + out for p, out in zip(prompts, free)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(actorlm.models.parts, "NgramProposer",
                      lambda k, *_: KnowingProposer(answers, k))
        with LLM(str(tiny_llama_dir), **flags, trace_file=str(path),
                 speculative_config={"method": "ngram", "num_speculative_tokens": K}) as llm:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], all_params,
                                   use_tqdm=False)
            stats = llm.stats()
    return SimpleNamespace(records=read_jsonl(path), stats=stats, outputs=outputs,
                           sequences={o.request_id: list(o.prompt_token_ids) +
                                      list(o.outputs[0].token_ids) for o in outputs})


def _steps(records):
    return [r for r in records if isinstance(r, StepSummary)]


def test_steps_record_the_drafts_verified_and_accepted_as_the_engine_counts_them(spec_run):
    steps, stats = _steps(spec_run.records), spec_run.stats
    assert stats["num_preemptions"] > 0 and stats["spec_num_accepted_tokens"] > 0
    assert spec_run.outputs[1].outputs[0].finish_reason == "stop"
    assert spec_run.records[0].num_speculative_tokens == K
    assert sum(s.num_draft_tokens for s in steps) == stats["spec_num_draft_tokens"]
    assert sum(s.num_accepted_drafts for s in steps) == stats["spec_num_accepted_tokens"]
    assert sum(s.num_verifications for s in steps) == stats["spec_num_drafts"]
    for s in steps:
        if not s.draft_token_ids:
            assert s.num_accepted_tokens == []
            continue
        assert len(s.draft_token_ids) == len(s.num_accepted_tokens) == len(s.request_ids)
        for rid, drafts, accepted, n, prefill in zip(
                s.request_ids, s.draft_token_ids, s.num_accepted_tokens,
                s.num_scheduled_tokens, s.is_prefill):
            assert 0 <= accepted <= len(drafts) <= K
            if drafts:  # a decode row: its newest token and the drafts after it
                assert n == len(drafts) + 1 and not prefill
                # what was accepted is the output there: a piece of the final sequence
                # (the stopped request's may run past its stop: those were cut)
                sequence, kept = spec_run.sequences[rid], drafts[:accepted]
                assert any(sequence[i:i + accepted] == kept
                           for i in range(len(sequence) - accepted + 1)) or rid == "1"


def test_the_timeline_perfetto_and_summary_count_the_same_drafts(spec_run):
    records, stats = spec_run.records, spec_run.stats
    drafted, accepted = stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]
    timeline = build_timeline(records)
    assert sum(lane.num_draft_tokens for lane in timeline.lanes) == drafted
    assert sum(lane.num_accepted_tokens for lane in timeline.lanes) == accepted
    for lane in timeline.lanes:  # a lane's drafts are its running segments'
        running = [s for s in lane.segments if s.state == "running"]
        assert sum(s.num_draft_tokens for s in running) == lane.num_draft_tokens
        assert sum(s.num_accepted_tokens for s in running) == lane.num_accepted_tokens
        assert all(s.num_draft_tokens == 0 for s in running if s.phase == "prefill")
    figures = summary_figures(timeline)
    assert figures["num_draft_tokens"] == drafted and figures["num_accepted_drafts"] == accepted
    assert figures["draft_acceptance_rate"] == round(100 * accepted / drafted, 1)
    assert figures["mean_acceptance_length"] == round(1 + accepted / stats["spec_num_drafts"], 2)

    events = to_perfetto(records)["traceEvents"]
    step_spans = [e for e in events if e["ph"] == "X" and e["cat"] == "step"]
    assert sum(e["args"].get("num_draft_tokens", 0) for e in step_spans) == drafted
    assert sum(a for e in step_spans for _, a in e["args"].get("drafts", {}).values()) == accepted
    counters = [e for e in events if e["ph"] == "C" and e["name"] == "drafts"]
    assert len(counters) == len(_steps(records))  # every step, so the counter drops to 0
    assert sum(e["args"]["accepted"] for e in counters) == accepted
    decode_spans = [e for e in events if e["ph"] == "X" and e["name"] == "decode"]
    assert sum(e["args"].get("num_draft_tokens", 0) for e in decode_spans) == drafted


def test_the_page_marks_each_verification_on_its_lane(spec_run, chromium, tmp_path):
    page = tmp_path / "spec.html"
    page.write_text(render_html(spec_run.records))
    data = _page_data(page.read_text())
    assert data["meta"]["num_speculative_tokens"] == K
    done = _headless(chromium, tmp_path, "--dump-dom", page.as_uri())
    assert done.returncode == 0, done.stderr[-2000:]
    dom = _DraftDom()
    dom.feed(done.stdout)
    assert "data-js-errors" not in dom.root, dom.root.get("data-js-errors")
    assert dom.root.get("data-rendered") == "true"
    timeline = build_timeline(spec_run.records)
    assert dom.lane_drafts == {lane.request_id: (lane.num_draft_tokens, lane.num_accepted_tokens,
                                                 len(lane.verifications))
                               for lane in timeline.lanes if lane.verifications}
    assert sum(d for d, _ in dom.step_drafts) == spec_run.stats["spec_num_draft_tokens"]
    assert sum(a for _, a in dom.step_drafts) == spec_run.stats["spec_num_accepted_tokens"]
    rate = summary_figures(timeline)["draft_acceptance_rate"]
    assert dom.text["figure:draft-acceptance"] == f"{rate}%drafts accepted"


class _DraftDom(_Dom):
    def __init__(self):
        super().__init__()
        self.lane_drafts: dict[str, tuple[int, int, int]] = {}
        self.step_drafts: list[tuple[int, int]] = []
        self._lane = None

    def handle_starttag(self, tag, attrs):
        found = dict(attrs)
        if "data-request-id" in found:
            self._lane = found["data-request-id"]
        if "data-draft-tokens" in found:
            pair = (int(found["data-draft-tokens"]), int(found["data-accepted-tokens"]))
            if "data-step" in found:
                self.step_drafts.append(pair)
            elif "data-request-id" in found:
                self.lane_drafts[self._lane] = pair
        if "data-verifications" in found:  # the lane's marks, inside its row
            self.lane_drafts[self._lane] += (int(found["data-verifications"]),)
        super().handle_starttag(tag, attrs)


def test_the_replay_reproduces_every_verification(spec_run):
    report = replay_trace(spec_run.records)
    assert report.matched, report.describe()
    recorded, replayed = _steps(spec_run.records), _steps(report.replayed)
    assert len(replayed) == len(recorded)
    assert [(list(map(len, s.draft_token_ids)), s.num_accepted_tokens) for s in replayed] == \
        [(list(map(len, s.draft_token_ids)), s.num_accepted_tokens) for s in recorded]
    # a trace that claims other acceptances schedules other tokens when replayed
    index = next(i for i, r in enumerate(spec_run.records)
                 if isinstance(r, StepSummary) and 0 < max(r.num_accepted_tokens, default=0))
    step = spec_run.records[index]
    edited = list(spec_run.records)
    edited[index] = msgspec.structs.replace(
        step, num_accepted_tokens=[max(0, a - 1) for a in step.num_accepted_tokens])
    assert not replay_trace(edited).matched

