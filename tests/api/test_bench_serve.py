"""``actorlm bench serve`` against the test server: it completes and reports like vLLM's."""

from __future__ import annotations

import json

import pytest

from actorlm.api.cli import main


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_bench_serve_json(server, capsys, endpoint):
    rc = main(["bench", "serve", "--base-url", server, "--endpoint", endpoint,
               "--num-prompts", "12", "--request-rate", "40", "--max-tokens", "8",
               "--ignore-eos", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["completed"] == 12 and result["failed"] == 0
    assert result["total_output_tokens"] == 12 * 8
    assert result["total_input_tokens"] > 0 and result["request_throughput"] > 0
    for metric in ("ttft", "tpot", "itl", "e2el"):
        values = [result[f"{stat}_{metric}_ms"] for stat in ("mean", "median", "p90", "p99")]
        assert all(v is not None and v >= 0 for v in values), (metric, values)
        assert result[f"median_{metric}_ms"] <= result[f"p99_{metric}_ms"]


def test_bench_serve_table(server, capsys):
    assert main(["bench", "serve", "--base-url", server, "--num-prompts", "4",
                 "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms)" in out and "P99 ITL (ms)" in out
