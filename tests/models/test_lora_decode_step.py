"""A decode step whose rows run with LoRA adapters takes the one-call C++ step
(``kernels/cpu/decode_step.py``, ``csrc/lora.cpp``) and computes what the Python layers compute
with the same adapters, bit for bit: rows of several adapters, scattered, beside rows of the
base model, in fp32 and bf16, with weights as floats or in GGUF blocks."""

from __future__ import annotations

import pytest
import torch
from gguf_files import write_gguf
from paged_contexts import PagedContexts

from actorlm import LoRARequest
from actorlm.kernels import select_backend
from actorlm.kernels.cpu import linear as cpu_linear
from actorlm.models.loader import load_model, resolve_model
from actorlm.models.lora_slots import LoRASlots

needs_kernels = pytest.mark.skipif(cpu_linear._kernel() is None,
                                   reason="the fp32 panel GEMM needs AVX-512 or AVX2 and FMA, "
                                          "and a C++ compiler")
needs_bf16_kernels = pytest.mark.skipif(cpu_linear._kernel(torch.bfloat16) is None,
                                        reason="the bf16 panel GEMM needs avx512_bf16")
PROMPTS = [[5, 9, 2, 7, 1], [3, 3, 8], [4, 1, 6, 2, 2, 9, 5, 3, 7], [8, 8, 1, 4], [2, 6]]
# request -> its adapter: two requests of alpha apart (scattered rows), one of the base model
ADAPTER_OF = ["alpha", None, "beta", "alpha", "gamma"]


def _loras(adapters) -> list[LoRARequest | None]:
    ids = {name: i for i, name in enumerate(sorted(adapters), 1)}
    return [None if name is None else LoRARequest(name, ids[name], str(adapters[name]))
            for name in ADAPTER_OF]


def _run(model, slots, loras, steps):
    """Logits of the prefill and of each step, each step's rows with their requests'
    adapters, on a fresh cache; and the cache."""
    cache, logits = PagedContexts(model, seed=3), []
    for chunks in [list(enumerate(PROMPTS)), *steps]:
        slots.set_mapping([loras[rid] for rid, _ in chunks], [len(t) for _, t in chunks])
        logits.append(cache.step(model, chunks))
    return logits, cache.kv_caches


def _assert_one_call_has_the_python_layers_bits(model, adapters, steps):
    slots = LoRASlots(model, max_loras=4, max_lora_rank=16, max_cpu_loras=None)
    one_call, loras = model.decode_step, _loras(adapters)
    assert one_call is not None and one_call.has_lora
    fused, fused_caches = _run(model, slots, loras, steps)
    assert one_call.num_steps == len(steps)  # each decode step with adapters ran in one call
    model.decode_step = None
    plain, plain_caches = _run(model, slots, loras, steps)
    model.decode_step = one_call
    for got, expected in zip(fused, plain, strict=True):
        assert torch.equal(got, expected)
    for (k, v), (k_ref, v_ref) in zip(fused_caches, plain_caches):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)
    # and the adapters change the logits of their rows, not the base model's
    base, _ = _run(model, slots, [None] * len(PROMPTS), steps)
    rows = [[rid for rid, _ in chunks] for chunks in steps]
    for got, expected, rids in zip(fused[1:], base[1:], rows):
        for row, rid in enumerate(rids):
            assert torch.equal(got[row], expected[row]) == (ADAPTER_OF[rid] is None)


def _decode_steps(num_requests, num_steps):
    return [[(rid, [10 + step + rid]) for rid in range(num_requests)] for step in range(num_steps)]


@needs_kernels
def test_fp32_decode_steps_with_adapters_have_the_python_layers_bits(tiny_llama_dir,
                                                                      tiny_llama_adapters):
    model = load_model(tiny_llama_dir, torch.float32, "cpu", select_backend("cpu"))
    steps = _decode_steps(5, 4)
    steps.append([(0, [12]), (2, [13]), (4, [14])])  # requests sit out: rows still in order
    _assert_one_call_has_the_python_layers_bits(model, tiny_llama_adapters, steps)


@needs_bf16_kernels
def test_bf16_decode_steps_with_adapters_have_the_python_layers_bits(tiny_llama_dir,
                                                                      tiny_llama_adapters):
    model = load_model(tiny_llama_dir, torch.bfloat16, "cpu", select_backend("cpu"))
    # (the bf16 panel GEMM takes one or two rows)
    steps = [[(0, [11]), (2, [12])], [(3, [13])], [(1, [14]), (4, [15])]]
    _assert_one_call_has_the_python_layers_bits(model, tiny_llama_adapters, steps)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(
    torch.bfloat16, marks=needs_bf16_kernels)], ids=str)
def test_decode_steps_with_adapters_on_weights_in_blocks_have_the_python_layers_bits(
        tiny_llama_dir, tiny_llama_adapters, tmp_path, dtype):
    file = write_gguf(tiny_llama_dir, tmp_path / "tiny.gguf", "Q8_0")
    model = load_model(resolve_model(file), dtype, "cpu", select_backend("cpu"))
    assert type(model.model.layers[0].self_attn.qkv_proj.prepared).__name__ == "QuantLinear"
    _assert_one_call_has_the_python_layers_bits(model, tiny_llama_adapters,
                                                _decode_steps(5, 4))


@needs_kernels
def test_a_step_with_adapters_the_one_call_cannot_take_runs_the_python_layers(
        tiny_llama_dir, tiny_llama_adapters):
    """A one-call step built before the layers had LoRA slots knows none: a step with
    adapters' rows is not its to run."""
    model = load_model(tiny_llama_dir, torch.float32, "cpu", select_backend("cpu"))
    without = model.decode_step
    slots = LoRASlots(model, max_loras=4, max_lora_rank=16, max_cpu_loras=None)
    assert model.decode_step is not without and not without.has_lora
    model.decode_step = without
    _run(model, slots, _loras(tiny_llama_adapters), _decode_steps(5, 2))
    assert without.num_steps == 0
