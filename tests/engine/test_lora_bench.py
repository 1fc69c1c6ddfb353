"""``bench throughput`` and ``bench latency`` with LoRA adapters (vLLM's ``--enable-lora
--lora-path``, and ``--num-loras``): the requests spread over the adapters, each run taking
turns with a run without them, and the ratio of each pair reported."""

from __future__ import annotations

import json
import statistics

import pytest

from actorlm.api.cli import main
from actorlm.models.lora_slots import LoRASlots


@pytest.fixture
def adapters_per_step(monkeypatch):
    """The adapter ids of every step the engine runs."""
    steps = []
    set_mapping = LoRASlots.set_mapping
    monkeypatch.setattr(LoRASlots, "set_mapping", lambda self, loras, n: steps.append(
        [None if lora is None else lora.lora_int_id for lora in loras]) or
        set_mapping(self, loras, n))
    return steps


def _run(capsys, *argv) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_bench_throughput_spreads_the_requests_over_the_adapters(
        tiny_llama_dir, tiny_llama_adapters, capsys, adapters_per_step):
    alpha, beta = str(tiny_llama_adapters["alpha"]), str(tiny_llama_adapters["beta"])
    result = _run(capsys, "bench", "throughput", "--model", str(tiny_llama_dir), "--dtype",
                  "float32", "--num-prompts", "6", "--output-len", "4", "--num-iters", "2",
                  "--enable-lora", "--max-loras", "3", "--lora-path", alpha, beta,
                  "--num-loras", "3", "--json")
    assert (result["num_loras"], result["max_loras"]) == (3, 3)
    assert result["lora_paths"] == sorted([alpha, beta])
    pairs = result["ratios_lora_vs_base"]
    assert len(pairs) == 2 and result["ratio_lora_vs_base"] == pytest.approx(
        statistics.median(pairs), abs=1e-3)
    assert result["lora_output_tokens_per_s"] > 0 and result["output_tokens_per_s"] > 0
    # runs of six requests: without adapters, then two on each of the three
    full = [step for step in adapters_per_step if len(step) == 6]
    assert [None] * 6 in full and [1, 2, 3, 1, 2, 3] in full


def test_bench_latency_runs_one_stream_with_an_adapter_and_without(
        tiny_llama_dir, tiny_llama_adapters, capsys, adapters_per_step):
    result = _run(capsys, "bench", "latency", "--model", str(tiny_llama_dir), "--dtype",
                  "float32", "--input-len", "8", "--output-len", "4", "--num-iters", "2",
                  "--enable-lora", "--lora-path", str(tiny_llama_adapters["gamma"]), "--json")
    assert result["num_loras"] == 1 and result["lora_tpot_ms"] > 0
    assert len(result["decode_ratios_lora_vs_base"]) == 2
    assert {step[0] for step in adapters_per_step} == {None, 1}


@pytest.mark.parametrize("argv, message", [
    (["--lora-path", "somewhere"], "--lora-path needs --enable-lora"),
    (["--num-loras", "2"], "--num-loras needs --lora-path"),
    (["--enable-lora", "--lora-path", "somewhere", "--num-loras", "0"],
     "--num-loras must be at least 1"),
])
def test_bench_lora_settings_that_cannot_work_are_refused_by_flag(argv, message, capsys):
    assert main(["bench", "throughput", "--num-prompts", "1", "--output-len", "1", *argv]) == 2
    assert message in capsys.readouterr().err
