"""A run with LoRA adapters: each arrival records its adapter, lanes and the Perfetto tracks
name it, and the replay holds the recorded steps to ``max_loras`` as the engine did."""

import msgspec
import pytest

from actorlm import LLM, LoRARequest, SamplingParams
from actorlm.trace import (Arrival, StepSummary, build_timeline, read_jsonl, render_html,
                           replay_trace, to_perfetto)
from test_exports import _page_data


@pytest.fixture(scope="module")
def lora_run(tiny_llama_dir, tiny_llama_adapters, tmp_path_factory):
    """Three adapters and the base model, two prompts each, at most two adapters a step."""
    path = tmp_path_factory.mktemp("lora") / "lora_run.jsonl"
    loras = [LoRARequest(name, i, str(p))
             for i, (name, p) in enumerate(sorted(tiny_llama_adapters.items()), 1)]
    prompts = [[5 + i, 17, 33, 8 + i, 91] for i in range(8)]
    with LLM(str(tiny_llama_dir), dtype="float32", enable_lora=True, max_loras=2,
             max_lora_rank=16, trace_file=str(path)) as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                     use_tqdm=False, lora_request=[*loras, None] * 2)
    return read_jsonl(path), loras


def test_arrivals_carry_their_adapter_and_lanes_show_it(lora_run):
    records, loras = lora_run
    assert records[0].max_loras == 2
    arrivals = [r for r in records if isinstance(r, Arrival)]
    submitted = [*loras, None] * 2
    assert [(a.lora_name, a.lora_int_id) for a in arrivals] == \
        [(x.lora_name, x.lora_int_id) if x else (None, 0) for x in submitted]
    by_lane = {lane.request_id: lane.lora_name for lane in build_timeline(records).lanes}
    assert sorted(by_lane.values(), key=str) == \
        sorted([x.lora_name if x else None for x in submitted], key=str)
    lanes = _page_data(render_html(records))["lanes"]
    assert {lane[0]: lane[12] for lane in lanes} == by_lane
    names = [e["args"]["name"] for e in to_perfetto(records)["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name" and
             e["args"]["name"].startswith("request ")]
    assert sorted(names) == sorted(f"request {rid}" + (f" ({lora})" if lora else "")
                                   for rid, lora in by_lane.items())


def test_the_replay_holds_steps_to_max_loras_as_recorded(lora_run):
    records, _ = lora_run
    adapters_per_step = []
    names = {a.request_id: a.lora_name for a in records if isinstance(a, Arrival)}
    for step in (r for r in records if isinstance(r, StepSummary)):
        adapters_per_step.append({names[rid] for rid in step.request_ids} - {None})
    assert max(map(len, adapters_per_step)) == 2  # the cap was reached: it decided steps
    report = replay_trace(records)
    assert report.matched, report.describe()
    # a replay allowed three adapters a step would schedule other steps
    looser = [msgspec.structs.replace(records[0], max_loras=3), *records[1:]]
    assert not replay_trace(looser).matched
