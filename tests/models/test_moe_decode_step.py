"""Routed experts inside the one-call decode step (``kernels/cpu/decode_step.py``): a
mixture-of-experts layer's router, top-k, experts and shared expert run in the same C++ call
as its attention, with the Python layers' bits (fp32, and bf16 for the rows its panels take)
on the tiny checkpoints of Qwen3-MoE (dense and routed layers mixed), Mixtral, Qwen2-MoE (a
gated shared expert, sliding layers) and OLMoE (q and k normed over their whole projections,
q/k/v clipped)."""

from __future__ import annotations

import pytest
import torch
from paged_contexts import PagedContexts
from test_decode_layers import (PROMPT_IDS, _assert_twins, _decode_steps, each_kernel_dtype,
                                needs_bf16_kernels, needs_kernels, rebuild_decode_step)

from actorlm.kernels import select_backend
from actorlm.kernels.cpu import linear as cpu_linear
from actorlm.models.loader import load_model

FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"]


@needs_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_decode_steps_in_one_call_have_the_python_layers_bits(family, tiny_moe_dirs):
    model = load_model(tiny_moe_dirs[family], torch.float32, "cpu", select_backend("cpu"))
    assert model.decode_step is not None
    steps = _decode_steps(3, 6) + [[(1, [12]), (2, [13])]]  # a request sits out
    _assert_twins(model, PROMPT_IDS, steps)
    assert model.decode_step.num_steps == len(steps)


@needs_bf16_kernels
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_decode_steps_up_to_the_panels_rows_have_the_python_layers_bits(family,
                                                                            tiny_moe_dirs):
    model = load_model(tiny_moe_dirs[family], torch.bfloat16, "cpu", select_backend("cpu"))
    limit = model.decode_step.max_rows  # two; 64 where the panels run on AMX tiles
    prompts = [PROMPT_IDS[rid % len(PROMPT_IDS)] for rid in range(limit + 1)]
    steps = [[(0, [11]), (1, [12])], [(2, [13])], [(0, [14])],
             [(rid, [15 + rid % 5]) for rid in range(limit)],  # the most the one call takes
             [(rid, [20 + rid % 5]) for rid in range(limit + 1)]]  # one more: the Python layers
    _assert_twins(model, prompts, steps)
    assert model.decode_step.num_steps == 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_of_one_stream_are_the_python_layers(family, dtype, tiny_moe_dirs):
    if cpu_linear._kernel(dtype) is None:
        pytest.skip(f"no {dtype} panel GEMM here")
    model = load_model(tiny_moe_dirs[family], dtype, "cpu", select_backend("cpu"))
    assert model.decode_step is not None
    runs = []
    for fused in (model.decode_step, None):
        model.decode_step, cache = fused, PagedContexts(model, seed=4)
        tokens = [int(cache.step(model, [(0, PROMPT_IDS[2])])[-1].argmax())]
        for _ in range(24):
            tokens.append(int(cache.step(model, [(0, tokens[-1:])])[-1].argmax()))
        runs.append(tokens)
    assert runs[0] == runs[1]


@needs_kernels
@each_kernel_dtype
def test_olmoe_clipping_that_bites_takes_the_one_call_with_the_python_layers_bits(
        tiny_moe_dirs, dtype):
    # the checkpoint's clip of 4 is rarely reached by a tiny model's q, k and v: a clip of
    # 0.05 cuts most of them, so a step that clipped otherwise (or not at all) differs
    model = load_model(tiny_moe_dirs["olmoe"], dtype, "cpu", select_backend("cpu"))
    for layer in model.model.layers:
        layer.self_attn.clip_qkv = 0.05
    rebuild_decode_step(model)
    rows = 3 if dtype == torch.float32 else 2  # (bf16 beyond two rows: oneDNN, in Python)
    steps = _decode_steps(rows, 4)
    _assert_twins(model, PROMPT_IDS[:rows], steps)
    assert model.decode_step.num_steps == len(steps)
