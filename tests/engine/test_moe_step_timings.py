"""The routers' and the experts' share of a mixture-of-experts model's forward
(``models.moe.MoeTimer``): measured on the Python layers (CPU and Triton backends) and inside
the one-call C++ decode step, carried by the runner's ``StepResult`` into each step's trace
record, and reported by ``bench latency --profile``; a dense model reports none."""

from __future__ import annotations

import json

import pytest
import torch

from actorlm.api.cli import main
from actorlm.core.scheduler import SchedulerConfig
from actorlm.kernels import select_backend
from actorlm.kernels.cpu import linear as cpu_linear
from actorlm.messages import AddRequest
from actorlm.models.loader import load_model
from actorlm.models.runner import ModelRunner
from actorlm.sampling_params import SamplingParams
from actorlm.trace import TraceRecorder
from actorlm.trace.records import StepSummary
from actorlm.trace.replay import SyncEngine
from actorlm.trace.step_breakdown import breakdown

needs_kernels = pytest.mark.skipif(cpu_linear._kernel() is None,
                                   reason="the fp32 panel GEMM needs AVX-512 and a C++ compiler")
PROMPTS = [[5 + (i * 13 + j * 7) % 300 for j in range(6 + 3 * i)] for i in range(3)]


def _traced_run(model_dir, python_layers: bool = False):
    """The model and the steps it ran (prefills of up to 16 tokens, then decodes), recorded."""
    backend = select_backend("cpu")
    model = load_model(model_dir, torch.float32, "cpu", backend)
    if python_layers:
        model.decode_step = None
    runner = ModelRunner(model, backend, 48, 4, torch.float32, torch.device("cpu"))
    engine = SyncEngine(SchedulerConfig(16, 4, 48, 4), 48, recorder=TraceRecorder(),
                        runner=runner,
                        kv_cache_windows=[group.window for group in runner.kv_cache_groups])
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.send(AddRequest(f"r{i}", prompt, params, 0, 0.0))
    engine.run_until_idle()
    steps = [r for r in engine.recorder.records() if isinstance(r, StepSummary) and
             r.request_ids and r.fault is None]
    assert any(s.num_prefill_tokens for s in steps) and any(not s.num_prefill_tokens
                                                            for s in steps)
    return model, steps


def _assert_within_forward(steps) -> None:
    for s in steps:
        assert 0 < s.router_s and 0 < s.experts_s
        assert s.router_s + s.experts_s <= s.forward_s


@pytest.mark.parametrize("backend", ["cpu", "triton"])  # (Triton: its CPU interpreter)
def test_python_layers_time_their_routers_and_experts_in_every_step(tiny_moe_dirs, backend,
                                                                    monkeypatch):
    monkeypatch.setenv("ACTORLM_ATTENTION_BACKEND", backend)
    # Qwen2-MoE: a shared expert (counted with the experts) and dense layers between
    model, steps = _traced_run(tiny_moe_dirs["qwen2_moe"], python_layers=True)
    assert model.backend.name == backend
    _assert_within_forward(steps)


@needs_kernels
@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_the_one_call_decode_step_times_its_routers_and_experts(tiny_moe_dirs, family):
    model, steps = _traced_run(tiny_moe_dirs[family])
    decodes = [s for s in steps if s.num_prefill_tokens == 0]
    assert model.decode_step is not None and model.decode_step.num_steps == len(decodes)
    _assert_within_forward(steps)
    # the last step's figures are the C++ step's own
    assert (steps[-1].router_s, steps[-1].experts_s) == model.decode_step.moe_seconds


def test_a_dense_model_reports_no_router_or_experts_time(tiny_llama_dir):
    model, steps = _traced_run(tiny_llama_dir)
    assert model.moe_timer is None
    assert all(s.router_s is None and s.experts_s is None for s in steps)
    out = breakdown(steps)
    assert "decode" in out and "prefill" in out
    assert not {"router_ms", "experts_ms"} & {*out["decode"], *out["prefill"]}


def test_bench_latency_profile_reports_router_and_experts_medians(tiny_moe_dirs, capsys):
    rc = main(["bench", "latency", "--model", str(tiny_moe_dirs["qwen3_moe"]), "--dtype",
               "float32", "--num-kv-blocks", "64", "--batch-size", "2", "--input-len", "12",
               "--output-len", "5", "--num-iters", "1", "--profile", "--json"])
    assert rc == 0
    profile = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["profile"]
    for kind in ("decode", "prefill"):
        figures = profile[kind]
        assert 0 < figures["router_ms"] <= figures["forward_ms"]
        assert 0 < figures["experts_ms"] <= figures["forward_ms"]
