"""A decode step through all layers in one C++ call (``kernels/cpu/decode_step.py``) computes
what the Python layers compute, bit for bit, in fp32 and (for one or two requests) bf16, and
steps it does not take fall back to them."""

from __future__ import annotations

import pytest
import torch
from test_model_vs_hf import PROMPTS, PagedContexts

from actorlm.kernels import select_backend
from actorlm.kernels.cpu import linear as cpu_linear
from actorlm.models.loader import load_model

needs_kernels = pytest.mark.skipif(cpu_linear._kernel() is None,
                                   reason="the fp32 panel GEMM needs AVX-512 and a C++ compiler")
needs_bf16_kernels = pytest.mark.skipif(cpu_linear._kernel(torch.bfloat16) is None,
                                        reason="the bf16 panel GEMM needs avx512_bf16")


def _counting(model) -> list[int]:
    """Counts the fused calls: [number of steps the one C++ call ran]."""
    calls, function = [0], model.decode_layers.function

    def counted(*args):
        calls[0] += 1
        return function(*args)

    model.decode_layers.function = counted
    return calls


def _twin_runs(model, prompts, steps):
    """Logits of the same prefill and decode steps with the one call and with the Python
    layers, each on its own (identically allocated) cache."""
    fused_layers, outputs = model.decode_layers, []
    for fused in (fused_layers, None):
        model.decode_layers = fused
        cache, logits = PagedContexts(model, seed=3), []
        logits.append(cache.step(model, list(enumerate(prompts))))
        for step in steps:
            logits.append(cache.step(model, step))
        outputs.append((logits, cache.kv_caches))
    model.decode_layers = fused_layers
    return outputs


@needs_kernels
@pytest.mark.parametrize("checkpoint", ["tiny_llama_dir", "tiny_qwen2_dir"])  # qwen2: qkv bias
def test_decode_steps_in_one_call_have_the_python_layers_bits(checkpoint, request):
    model = load_model(request.getfixturevalue(checkpoint), torch.float32, "cpu",
                       select_backend("cpu"))
    assert model.decode_layers is not None
    calls = _counting(model)
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8], [4, 1, 6, 2, 2, 9, 5, 3, 7]]
    steps = [[(rid, [10 + step + rid]) for rid in range(3)] for step in range(6)]
    steps.append([(1, [12]), (2, [13])])  # a request sits out: rows are still in order
    (fused, fused_caches), (plain, plain_caches) = _twin_runs(model, prompts, steps)
    assert calls[0] == len(steps)  # every decode step took the one call, the prefill did not
    for got, expected in zip(fused, plain):
        assert torch.equal(got, expected)
    for (k, v), (k_ref, v_ref) in zip(fused_caches, plain_caches):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


@needs_kernels
def test_steps_that_are_not_pure_decode_run_the_python_layers(tiny_llama_dir):
    model = load_model(tiny_llama_dir, torch.float32, "cpu", select_backend("cpu"))
    calls = _counting(model)
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8]]
    steps = [[(0, [11]), (1, [12, 13, 14])],  # a decode row beside a prefill chunk
             [(2, [1, 2, 3]), (0, [15])]]  # a new prompt first: the decode row is not row 0
    (fused, _), (plain, _) = _twin_runs(model, prompts, steps)
    assert calls[0] == 0
    for got, expected in zip(fused, plain):
        assert torch.equal(got, expected)


@needs_bf16_kernels
def test_bf16_decode_steps_of_one_or_two_requests_have_the_python_layers_bits(tiny_qwen2_dir):
    model = load_model(tiny_qwen2_dir, torch.bfloat16, "cpu", select_backend("cpu"))
    assert model.decode_layers is not None
    calls = _counting(model)
    prompts = [[5, 9, 2, 7, 1], [3, 3, 8], [4, 1, 6, 2, 2, 9, 5, 3, 7]]
    steps = [[(0, [11]), (1, [12])], [(2, [13])],  # two rows, one row: the one call
             [(rid, [14 + rid]) for rid in range(3)]]  # three rows: oneDNN's GEMM, in Python
    (fused, fused_caches), (plain, plain_caches) = _twin_runs(model, prompts, steps)
    assert calls[0] == 2
    for got, expected in zip(fused, plain):
        assert torch.equal(got, expected)
    for (k, v), (k_ref, v_ref) in zip(fused_caches, plain_caches):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_models_without_qk_norms_take_the_one_call_where_their_kernels_are_built(
        tiny_llama_dir, tiny_qwen3_dir):
    backend = select_backend("cpu")
    assert load_model(tiny_qwen3_dir, torch.float32, "cpu", backend).decode_layers is None
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(tiny_llama_dir, dtype, "cpu", backend)
        assert (model.decode_layers is not None) == (cpu_linear._kernel(dtype) is not None)


@needs_kernels
def test_prompts_of_the_oracle_decode_alike(tiny_llama_dir):
    # greedy continuations of real prompts: the one call agrees with the Python layers
    from transformers import AutoTokenizer

    model = load_model(tiny_llama_dir, torch.float32, "cpu", select_backend("cpu"))
    prompts = [AutoTokenizer.from_pretrained(tiny_llama_dir)(p).input_ids for p in PROMPTS]
    tokens = {}
    for fused in (model.decode_layers, None):
        model.decode_layers, cache = fused, PagedContexts(model, seed=4)
        logits = cache.step(model, list(enumerate(prompts)))
        last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        out = [[t] for t in logits[last].argmax(-1).tolist()]
        for _ in range(8):
            logits = cache.step(model, [(rid, o[-1:]) for rid, o in enumerate(out)])
            for o, t in zip(out, logits.argmax(-1).tolist()):
                o.append(t)
        tokens[fused is None] = out
    assert tokens[False] == tokens[True]
