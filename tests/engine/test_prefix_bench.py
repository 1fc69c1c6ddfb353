"""``bench prefix``: caching on against off on the multi-turn and shared-prompt workloads."""

import json

import pytest

from actorlm.bench.prefix import main

_MODE_KEYS = {"prefill_tokens", "prefill_tokens_per_batch", "cached_tokens",
              "prefix_cache_queries", "prefix_cache_hits", "ttft_p50_ms", "ttft_p90_ms",
              "output_tokens_per_s", "wall_s"}
_RATIOS = ("prefill_tokens_ratio", "ttft_p50_ratio", "ttft_p90_ratio", "throughput_ratio")


def test_caching_computes_fewer_prefill_tokens_for_the_same_outputs(tiny_llama_dir, capsys):
    rc = main(["--model", str(tiny_llama_dir), "--dtype", "float32", "--block-size", "4",
               "--num-kv-blocks", "512", "--num-conversations", "2", "--num-turns", "3",
               "--output-len", "6", "--system-prompt-len", "40", "--num-questions", "3",
               "--shared-prompt-len", "40", "--num-iters", "2", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["num_iters"] == 2 and result["output_len"] == 6
    multi, shared = result["multi_turn"], result["shared_prompt"]
    assert multi["num_requests"] == 2 * 3 and shared["num_requests"] == 3
    for workload in (multi, shared):
        on, off = workload["on"], workload["off"]
        assert on.keys() == off.keys() == _MODE_KEYS
        assert all(workload[name] is not None and workload[name] > 0 for name in _RATIOS)
        assert workload["output_tokens"] == 6 * workload["num_requests"]
        # off computes every prompt token; on serves part of them from the cache
        assert off["prefill_tokens"] >= workload["prompt_tokens"] and off["cached_tokens"] == 0
        assert 0 < on["prefill_tokens"] < off["prefill_tokens"]
        assert 0 < on["cached_tokens"] <= on["prefix_cache_hits"] <= on["prefix_cache_queries"]
        assert workload["prefill_tokens_ratio"] == pytest.approx(
            on["prefill_tokens"] / off["prefill_tokens"], abs=1e-3)
        assert sum(on["prefill_tokens_per_batch"]) == on["prefill_tokens"]
        assert 0 < on["ttft_p50_ms"] <= on["ttft_p90_ms"] and on["wall_s"] > 0
        assert workload["identical_outputs"]
    # one batch per turn; from the second turn on, each finds the turn before it cached
    assert len(multi["on"]["prefill_tokens_per_batch"]) == 3
    first_on, *later_on = multi["on"]["prefill_tokens_per_batch"]
    first_off, *later_off = multi["off"]["prefill_tokens_per_batch"]
    assert all(on < off for on, off in zip(later_on, later_off)) and first_on <= first_off


@pytest.mark.parametrize("argv", [["--num-turns", "0"], ["--num-iters", "0"],
                                  ["--no-enable-prefix-caching"]])
def test_bench_prefix_refuses_bad_flags_before_loading_anything(argv, capsys):
    assert main([*argv, "--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "must be at least 1" in err or "runs with caching on and off itself" in err
