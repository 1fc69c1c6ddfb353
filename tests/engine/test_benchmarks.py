"""``actorlm bench latency`` and the per-step breakdown behind ``--profile``."""

import json
import statistics

import msgspec
import pytest

from actorlm.api.cli import main
from actorlm.trace.step_breakdown import breakdown
from actorlm.trace.records import StepSummary


def _step(step, t_start, t_end, num_prefill=0, forward=0.0, sample=0.0, prepare=0.0,
          fault=None):
    return StepSummary(step, t_start, t_end, t_end - t_start, ["a", "b"], [1, 1], [False, False],
                       num_prefill, 2 - num_prefill, [], [], 0, 0, 0, 2, 0, fault=fault,
                       prepare_s=prepare, forward_s=forward, sample_s=sample)


def test_breakdown_splits_each_busy_period_into_forward_sampling_and_the_rest():
    records = [
        _step(0, 0.000, 0.009, num_prefill=2, forward=0.006, sample=0.001),
        _step(1, 0.010, 0.014, forward=0.002, sample=0.001, prepare=0.0005),
        _step(2, 0.015, 0.018, forward=0.002, sample=0.001),
        _step(3, 0.019, 0.020, fault="worker 0 died"),  # not a step that ran
        _step(4, 0.021, 0.025, forward=0.002, sample=0.001),
        _step(5, 1.000, 1.004, forward=0.002, sample=0.001),  # after an idle second
        _step(6, 1.005, 1.009, forward=0.002, sample=0.001),
    ]
    out = breakdown(records, since=0.005)
    # periods: 1 -> 2 (5 ms), 2 -> 4 (6 ms), 5 -> 6 (5 ms); 4 -> 5 is idle, 6 is the last
    assert out["num_steps"] == 3 and "prefill" not in out
    decode = out["decode"]
    assert decode["step_ms"] == 5.0 and decode["forward_ms"] == 2.0
    assert decode["sample_ms"] == 1.0 and decode["engine_overhead_ms"] == 2.0
    assert breakdown(records)["prefill"]["step_ms"] == 10.0
    assert "router_ms" not in decode and "experts_ms" not in decode  # a dense model's


def test_breakdown_gives_the_median_router_and_experts_time_of_moe_steps():
    def moe(step, t_start, t_end, router, experts, num_prefill=0):
        return msgspec.structs.replace(_step(step, t_start, t_end, num_prefill, forward=0.004),
                                       router_s=router, experts_s=experts)

    records = [moe(0, 0.000, 0.005, 0.0010, 0.0030, num_prefill=2),
               moe(1, 0.006, 0.010, 0.0002, 0.0010), moe(2, 0.011, 0.015, 0.0004, 0.0020),
               moe(3, 0.016, 0.020, 0.0003, 0.0030), moe(4, 0.021, 0.025, 0.0002, 0.0010)]
    out = breakdown(records)
    assert (out["decode"]["router_ms"], out["decode"]["experts_ms"]) == (0.3, 2.0)
    assert (out["prefill"]["router_ms"], out["prefill"]["experts_ms"]) == (1.0, 3.0)


@pytest.mark.slow
def test_bench_latency_reports_the_engine_transformers_and_the_breakdown(tiny_llama_dir, capsys):
    rc = main(["bench", "latency", "--model", str(tiny_llama_dir), "--dtype", "float32",
               "--num-kv-blocks", "256", "--batch-size", "3", "--input-len", "24",
               "--output-len", "12", "--num-iters", "2", "--compare", "hf", "--profile",
               "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["batch_size"] == 3 and result["input_len"] == 24
    assert 0 < result["ttft_ms"] and 0 < result["tpot_ms"] < 1e3 * result["e2e_s"]
    assert result["decode_tokens_per_s"] == pytest.approx(3e3 / result["tpot_ms"], rel=0.01)
    assert result["hf_ttft_ms"] > 0 and result["hf_decode_tokens_per_s"] > 0
    pairs = result["decode_ratios_vs_hf"]  # each engine run against the next transformers run
    assert len(pairs) == 2 and result["decode_ratio_vs_hf"] == pytest.approx(
        statistics.median(pairs), abs=1e-3)
    # the ratio of the two sides' medians (here means) lies between the pairs' ratios, up to
    # the rounding of the reported figures (TPOTs to 0.01 ms, ratios to 0.001)
    hf_tpot, tpot = result["hf_tpot_ms"], result["tpot_ms"]
    assert (hf_tpot - 0.005) / (tpot + 0.005) <= max(pairs) + 0.0005
    assert min(pairs) - 0.0005 <= (hf_tpot + 0.005) / (tpot - 0.005)
    decode = result["profile"]["decode"]
    assert decode["num_requests"] == 3 and decode["num_steps"] >= 2 * 8
    assert decode["forward_ms"] > 0 and decode["sample_ms"] > 0
    assert decode["step_ms"] >= decode["forward_ms"] + decode["sample_ms"]
    assert decode["engine_overhead_ms"] >= decode["prepare_ms"] >= 0


def test_bench_latency_reports_the_acceptance_of_prompt_lookup_on_grounded_work(
        tiny_llama_dir, capsys):
    rc = main(["bench", "latency", "--model", str(tiny_llama_dir), "--dtype", "float32",
               "--num-kv-blocks", "256", "--input-len", "40", "--output-len", "16",
               "--num-iters", "1", "--workload", "grounded", "--json", "--speculative-config",
               '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["workload"] == "grounded"
    assert result["spec_acceptance_length"] >= 1.0  # 1 + accepted drafts per verification
    assert 0.0 <= result["spec_draft_acceptance_rate"] <= 1.0


def test_bench_latency_refuses_an_output_too_short_to_decode(tiny_llama_dir, capsys):
    assert main(["bench", "latency", "--model", str(tiny_llama_dir), "--output-len", "1"]) == 2
    assert "--output-len" in capsys.readouterr().err


def test_one_long_request_costs_a_decode_step_about_its_own_context(tiny_llama_long_dir):
    from actorlm.bench.mixed_lengths import step_costs

    result = step_costs(tiny_llama_long_dir, num_short=63, short_len=100, long_len=7000)
    # padded to the longest context this was ~10x; the bound is generous so it cannot flake
    assert result["ratio"] < 4, result


def test_bench_structured_compares_constrained_rounds_with_free_text(tiny_llama_dir, capsys):
    rc = main(["bench", "structured", "--model", str(tiny_llama_dir), "--dtype", "float32",
               "--num-prompts", "3", "--output-len", "8", "--num-iters", "1", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for mode in ("json_schema", "regex"):
        assert result[mode]["ratio_vs_free"] == pytest.approx(
            result[mode]["output_tokens_per_s"] / result["free"]["output_tokens_per_s"], rel=0.01)
    assert 0 < result["free"]["output_tokens"] <= 3 * 8


def test_bench_embed_compares_with_sentence_transformers(tiny_embedding_dirs, capsys):
    rc = main(["bench", "embed", "--model", str(tiny_embedding_dirs["qwen3_last"]), "--dtype",
               "float32", "--num-prompts", "5", "--input-len", "24", "--num-iters", "2",
               "--compare", "st", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_prompts"] == 5 and 18 <= result["mean_prompt_tokens"] <= 26
    assert result["max_cosine_distance_vs_st"] < 1e-6  # the same vectors, prompt for prompt
    assert result["ratio_vs_st"] == statistics.median(
        st / ours for st, ours in zip(result["st_seconds"], result["seconds"]))


@pytest.mark.parametrize("argv", [["latency", "--num-iters", "0"], ["latency", "--batch-size", "0"],
                                  ["throughput", "--num-prompts", "0", "--output-len", "2"],
                                  ["structured", "--num-iters", "0"],
                                  ["embed", "--input-len", "0"]])
def test_benches_refuse_counts_below_one_before_loading_anything(argv, capsys):
    assert main(["bench", *argv]) == 2
    assert "must be at least 1" in capsys.readouterr().err
