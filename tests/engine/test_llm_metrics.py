"""vLLM's ``LLM.get_metrics()``: with ``disable_log_stats=False`` the offline engine keeps
vLLM's metrics (the engine's gauges and counters, each finished request's token counts and
latencies from the times its frontend noted) and returns them as ``metrics_reader`` records;
each ``RequestOutput.metrics`` carries those times. ``snapshot`` reads counters, gauges,
histograms and per-position vectors as vLLM's reader does."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram

from actorlm import SamplingParams
from actorlm.metrics_reader import Counter as CounterRecord
from actorlm.metrics_reader import Gauge, Vector, snapshot
from actorlm.metrics_reader import Histogram as HistogramRecord

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
MAX_TOKENS = 5


def _one(records, name, kind, **labels):
    found = [r for r in records if r.name == name and isinstance(r, kind) and
             labels.items() <= r.labels.items()]
    assert len(found) == 1, (name, found)
    return found[0]


def test_an_offline_engine_counts_and_times_its_requests(make_llm, tiny_llama_dir):
    llm = make_llm(str(tiny_llama_dir), disable_log_stats=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                           SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    for output in outputs:  # the times the frontend noted, in order
        stats = output.metrics
        assert stats.num_generation_tokens == MAX_TOKENS
        assert stats.arrival_time < stats.first_token_ts <= stats.last_token_ts
    records = llm.get_metrics()
    assert {r.name.split(":")[0] for r in records} == {"vllm", "actorlm"}
    assert _one(records, "vllm:prompt_tokens", CounterRecord).value == sum(map(len, PROMPTS))
    assert _one(records, "vllm:generation_tokens", CounterRecord).value == MAX_TOKENS * 3
    assert _one(records, "vllm:request_success", CounterRecord,
                finished_reason="length").value == 3
    assert _one(records, "vllm:prefix_cache_queries", CounterRecord, engine="0").value == \
        sum(map(len, PROMPTS))
    assert _one(records, "vllm:num_requests_running", Gauge).value == 0
    ttft = _one(records, "vllm:time_to_first_token_seconds", HistogramRecord)
    e2e = _one(records, "vllm:e2e_request_latency_seconds", HistogramRecord)
    tpot = _one(records, "vllm:request_time_per_output_token_seconds", HistogramRecord)
    assert ttft.count == e2e.count == tpot.count == 3
    assert 0 < ttft.sum < e2e.sum and tpot.sum > 0
    assert ttft.buckets["+Inf"] == 3 and list(ttft.buckets.values()) == \
        sorted(ttft.buckets.values())  # cumulative
    assert ttft.labels == {"model_name": str(tiny_llama_dir)}  # (the model as given)
    assert _one(records, "vllm:inter_token_latency_seconds", HistogramRecord).count == 0


def test_the_kv_caches_settings_are_vllms_cache_config_info(make_llm, tiny_llama_dir):
    llm = make_llm(str(tiny_llama_dir), disable_log_stats=False, kv_cache_dtype="fp8_e5m2",
                   num_kv_blocks=64, block_size=8)
    info = _one(llm.get_metrics(), "vllm:cache_config_info", Gauge)
    assert info.value == 1 and info.labels == {
        "block_size": "8", "cache_dtype": "fp8_e5m2", "enable_prefix_caching": "True",
        "num_gpu_blocks": "64"}


def test_without_stats_there_are_no_metrics_to_read(make_llm, tiny_llama_dir):
    llm = make_llm(str(tiny_llama_dir))
    assert llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(max_tokens=2),
                        use_tqdm=False)[0].metrics.num_generation_tokens == 2
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        llm.get_metrics()


def test_a_snapshot_reads_every_kind_as_vllms_reader_does():
    registry = CollectorRegistry(auto_describe=False)
    per_position = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "", ["engine",
                                                                              "position"],
                           registry=registry)
    for position, count in ((1, 4), (0, 9), (2, 1)):
        per_position.labels("0", str(position)).inc(count)
    latency = Histogram("vllm:e2e_request_latency_seconds", "", ["model_name"],
                        buckets=(0.5, 1.0), registry=registry)
    for seconds in (0.2, 0.7, 3.0):
        latency.labels("m").observe(seconds)
    Counter("process_other", "", registry=registry).inc()  # not the engine's: left out
    assert snapshot(registry) == [
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", {"engine": "0"}, [9, 4, 1]),
        HistogramRecord("vllm:e2e_request_latency_seconds", {"model_name": "m"}, 3,
                        pytest.approx(3.9), {"0.5": 1, "1.0": 2, "+Inf": 3})]
