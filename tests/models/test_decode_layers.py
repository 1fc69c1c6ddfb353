"""A decode step through all layers in one C++ call (``kernels/cpu/decode_step.py``) computes
what the Python layers compute, bit for bit, in fp32 and, for the rows the bf16 panels take
(two; 64 on AMX tiles), bf16; it executes each layer's description, so a family with q/k
norms (Qwen3), or one that describes other norms and activations, a sliding window or capped
scores, takes it as Llama does; layers of two KV-cache groups read each their own group's
blocks; steps it does not take fall back."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_contexts import PagedContexts
from test_model_vs_hf import PROMPTS

from actorlm.kernels import select_backend
from actorlm.kernels.cpu import linear as cpu_linear
from actorlm.models import causal_lm
from actorlm.models.layers import SplitRMSNorm
from actorlm.models.loader import load_hf_config, load_model
from actorlm.models.parallel import TensorParallel

needs_kernels = pytest.mark.skipif(cpu_linear._kernel() is None,
                                   reason="the fp32 panel GEMM needs AVX-512 or AVX2 and FMA, and a C++ compiler")
needs_bf16_kernels = pytest.mark.skipif(cpu_linear._kernel(torch.bfloat16) is None,
                                        reason="the bf16 panel GEMM needs avx512_bf16")
# fp32, and bf16 where its panel GEMM is built
each_kernel_dtype = pytest.mark.parametrize(
    "dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_kernels)], ids=str)
PROMPT_IDS = [[5, 9, 2, 7, 1], [3, 3, 8], [4, 1, 6, 2, 2, 9, 5, 3, 7]]


def rebuild_decode_step(model):
    """The model's one-call step rebuilt over its layers' plans (after a test changed a
    layer), as ``prepare_kernels`` builds it."""
    model.decode_step = model.backend.decode_step([layer.plan() for layer in model.model.layers],
                                                  model.dtype)


def _twin_runs(model, prompts, steps):
    """Logits of the same prefill and decode steps with the one call and with the Python
    layers, each on its own (identically allocated) cache."""
    one_call, outputs = model.decode_step, []
    for fused in (one_call, None):
        model.decode_step = fused
        cache, logits = PagedContexts(model, num_blocks=max(96, 8 * len(prompts)), seed=3), []
        logits.append(cache.step(model, list(enumerate(prompts))))
        for step in steps:
            logits.append(cache.step(model, step))
        outputs.append((logits, cache.kv_caches))
    model.decode_step = one_call
    return outputs


def _assert_twins(model, prompts, steps):
    (fused, fused_caches), (plain, plain_caches) = _twin_runs(model, prompts, steps)
    for got, expected in zip(fused, plain):
        assert torch.equal(got, expected)
    for (k, v), (k_ref, v_ref) in zip(fused_caches, plain_caches):
        assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def _decode_steps(num_requests, num_steps):
    return [[(rid, [10 + step + rid]) for rid in range(num_requests)] for step in range(num_steps)]


@needs_kernels
@pytest.mark.parametrize("checkpoint", ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_decode_steps_in_one_call_have_the_python_layers_bits(checkpoint, request):
    # qwen2: qkv bias; qwen3: q/k norms
    model = load_model(request.getfixturevalue(checkpoint), torch.float32, "cpu",
                       select_backend("cpu"))
    assert model.decode_step is not None
    steps = _decode_steps(3, 6)
    steps.append([(1, [12]), (2, [13])])  # a request sits out: rows are still in order
    _assert_twins(model, PROMPT_IDS, steps)
    assert model.decode_step.num_steps == len(steps)  # every decode step, not the prefill


@needs_kernels
def test_steps_that_are_not_pure_decode_run_the_python_layers(tiny_llama_dir):
    model = load_model(tiny_llama_dir, torch.float32, "cpu", select_backend("cpu"))
    steps = [[(0, [11]), (1, [12, 13, 14])],  # a decode row beside a prefill chunk
             [(2, [1, 2, 3]), (0, [15])]]  # a new prompt first: the decode row is not row 0
    _assert_twins(model, PROMPT_IDS[:2], steps)
    assert model.decode_step.num_steps == 0


@needs_bf16_kernels
@pytest.mark.parametrize("checkpoint", ["tiny_qwen2_dir", "tiny_qwen3_dir"])
def test_bf16_decode_steps_up_to_the_panels_rows_have_the_python_layers_bits(checkpoint,
                                                                            request):
    model = load_model(request.getfixturevalue(checkpoint), torch.bfloat16, "cpu",
                       select_backend("cpu"))
    limit = model.decode_step.max_rows  # two; 64 where the panels run on AMX tiles
    prompts = [PROMPT_IDS[rid % len(PROMPT_IDS)] for rid in range(limit + 1)]
    steps = [[(0, [11]), (1, [12])], [(2, [13])],  # two rows, one row: the one call
             [(rid, [14 + rid % 5]) for rid in range(limit)],  # the most it takes
             [(rid, [20 + rid % 5]) for rid in range(limit + 1)]]  # one more: in Python
    _assert_twins(model, prompts, steps)
    assert model.decode_step.num_steps == 3


@needs_kernels
@each_kernel_dtype
@pytest.mark.parametrize("input_norms", [True, False], ids=["input_norms", "output_norms_only"])
def test_a_layer_described_otherwise_takes_the_one_call_with_the_python_layers_bits(
        tiny_qwen3_dir, monkeypatch, dtype, input_norms):
    # a family with output norms after attention and MLP, unit-offset norms (1 + weight) and
    # GeLU-tanh (Gemma's layer), with each branch's output scaled (Granite's), with or without
    # norms on the branches' inputs (OLMo 2 has none): a description
    specs = causal_lm.layer_specs(load_hf_config(tiny_qwen3_dir))
    described = [dataclasses.replace(spec, output_norms=True, norm_unit_offset=True,
                                     activation="gelu_tanh", attention_scale=0.2,
                                     residual_scale=0.22, input_norms=input_norms)
                 for spec in specs]
    monkeypatch.setattr(causal_lm, "layer_specs", lambda config: described)
    model = causal_lm.CausalLM(load_hf_config(tiny_qwen3_dir), select_backend("cpu"),
                                   dtype=dtype)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * (0.3 if "norm" in name else 1))
    model.prepare_kernels()
    assert model.decode_step is not None
    steps = _decode_steps(2, 4)
    _assert_twins(model, PROMPT_IDS[:2], steps)
    assert model.decode_step.num_steps == len(steps)


def test_the_one_call_is_built_where_its_kernels_are(tiny_llama_dir, tiny_qwen3_dir):
    backend = select_backend("cpu")
    for checkpoint in (tiny_llama_dir, tiny_qwen3_dir):
        for dtype in (torch.float32, torch.bfloat16):
            model = load_model(checkpoint, dtype, "cpu", backend)
            assert (model.decode_step is not None) == (cpu_linear._kernel(dtype) is not None)


def _describe(model, kv_groups=None, **attention):
    """The model's layers described otherwise (``attention``: AttentionLayer fields for every
    layer, or per layer as lists; ``kv_groups``: each layer's group), and its one-call step
    rebuilt over them as ``prepare_kernels`` builds it."""
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.layer = layer.self_attn.layer._replace(**{
            name: value[i] if isinstance(value, list) else value
            for name, value in attention.items()})
        if kv_groups is not None:
            layer.kv_group = kv_groups[i]
    rebuild_decode_step(model)
    return model


@needs_kernels
@each_kernel_dtype
def test_a_sliding_window_and_capped_scores_take_the_one_call_with_the_python_layers_bits(
        tiny_llama_dir, dtype):
    # a window of 6 positions over blocks of 4, contexts up to 16: the window cuts most reads
    model = _describe(load_model(tiny_llama_dir, dtype, "cpu", select_backend("cpu")),
                      window=6, softcap=2.0)
    assert model.decode_step is not None
    rows = 3 if dtype == torch.float32 else 2  # (bf16 beyond two rows: oneDNN, in Python)
    steps = _decode_steps(rows, 7)
    _assert_twins(model, PROMPT_IDS[:rows], steps)
    assert model.decode_step.num_steps == len(steps)


class GroupedContexts(PagedContexts):
    """``PagedContexts`` with each group's window (``windows``), as the allocator keeps its
    tables: after each step, a sliding group's blocks that hold only positions before the next
    query's window are freed (with ``free``): their entries become the placeholder block 0, the
    block goes back to the pool, first in line for the next request that needs one, and its
    memory is NaN in every layer until rewritten. Block 0 is NaN from the start. So a kernel
    that reads one freed block, even to mask it, returns NaN."""

    def __init__(self, model, windows, free=True, num_blocks=128, block_size=4, seed=0):
        super().__init__(model, num_blocks, block_size, seed, num_groups=len(windows))
        self.windows, self.free = windows, free
        if free:
            self._poison(0)

    def step(self, model, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        logits = super().step(model, chunks)
        if self.free:
            self._free_out_of_window()
        return logits

    def _free_out_of_window(self):
        for window, tables in zip(self.windows, self.tables):
            for rid, blocks in tables.items():
                first_seen = 0 if window is None else max(0, self.lens[rid] - window + 1)
                for j in range(first_seen // self.block_size):
                    if blocks[j] != 0:
                        self._poison(blocks[j])
                        self.pool.append(blocks[j])
                        blocks[j] = 0

    def _poison(self, block: int):
        for k, v in self.kv_caches:
            k[block], v[block] = float("nan"), float("nan")


@needs_kernels
def test_layers_of_two_kv_groups_read_their_own_groups_blocks_and_never_freed_ones(
        tiny_llama_dir):
    # layer 0 attends over everything (group 0), layer 1 through a window of 6 (group 1);
    # each group's tables name other blocks, and group 1 frees what its window leaves
    model = _describe(load_model(tiny_llama_dir, torch.float32, "cpu", select_backend("cpu")),
                      kv_groups=[0, 1], window=[None, 6], softcap=[None, 2.0])
    windows = [None, 6]
    steps = _decode_steps(3, 3) + [[(0, [11]), (1, list(range(12, 20)))]] + _decode_steps(3, 4)
    one_call, runs = model.decode_step, []
    # the one call and the Python layers with blocks freed, the Python layers with none
    for model.decode_step, free in ((one_call, True), (None, True), (None, False)):
        contexts = GroupedContexts(model, windows, free=free)
        runs.append(([contexts.step(model, list(enumerate(PROMPT_IDS)))] +
                     [contexts.step(model, step) for step in steps], contexts))
    model.decode_step = one_call
    (fused, contexts), (plain, plain_contexts), (clean, _) = runs
    assert model.decode_step.num_steps == len(steps) - 1  # every decode step
    assert contexts.tables[0] != contexts.tables[1] and 0 in contexts.tables[1][2]
    for got, expected, unfreed in zip(fused, plain, clean):
        assert torch.isfinite(got).all()
        assert torch.equal(got, expected) and torch.equal(got, unfreed)
    for (k, v), (k_ref, v_ref) in zip(contexts.kv_caches, plain_contexts.kv_caches):
        torch.testing.assert_close(k, k_ref, rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(v, v_ref, rtol=0, atol=0, equal_nan=True)


@needs_kernels
def test_prompts_of_the_oracle_decode_alike(tiny_llama_dir):
    # greedy continuations of real prompts: the one call agrees with the Python layers
    from transformers import AutoTokenizer

    model = load_model(tiny_llama_dir, torch.float32, "cpu", select_backend("cpu"))
    prompts = [AutoTokenizer.from_pretrained(tiny_llama_dir)(p).input_ids for p in PROMPTS]
    tokens = {}
    for fused in (model.decode_step, None):
        model.decode_step, cache = fused, PagedContexts(model, seed=4)
        logits = cache.step(model, list(enumerate(prompts)))
        last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
        out = [[t] for t in logits[last].argmax(-1).tolist()]
        for _ in range(8):
            logits = cache.step(model, [(rid, o[-1:]) for rid, o in enumerate(out)])
            for o, t in zip(out, logits.argmax(-1).tolist()):
                o.append(t)
        tokens[fused is None] = out
    assert tokens[False] == tokens[True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_q_and_k_normed_over_whole_projections_and_clipped_take_the_one_call_with_the_python_bits(
        tiny_llama_dir, dtype):
    # OLMoE's attention (its q and k normed each as one vector over all heads, q/k/v then
    # clipped) described on a Llama in Q8_0 blocks, whose linear layers the one call takes
    # with or without AVX-512; a clip of 0.05 cuts most values, so one applied otherwise (or
    # not at all) differs
    model = load_model(tiny_llama_dir, dtype, "cpu", select_backend("cpu"), quantization="q8_0")
    gen = torch.Generator().manual_seed(7)
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.projection_norms, attn.clip_qkv = True, 0.05
        attn.q_norm, attn.k_norm = (
            SplitRMSNorm(size, 1e-5, model.backend, dtype, "cpu", TensorParallel())
            for size in (attn.q_size, attn.kv_size))
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.copy_(1 + 0.5 * torch.randn(norm.weight.shape, generator=gen))
    rebuild_decode_step(model)
    assert model.decode_step is not None
    rows = 3 if dtype == torch.float32 else 2
    steps = _decode_steps(rows, 4)
    _assert_twins(model, PROMPT_IDS[:rows], steps)
    assert model.decode_step.num_steps == len(steps)


@needs_kernels
@each_kernel_dtype
@pytest.mark.parametrize("weights, activations", [("channel", "token"), ("tensor", "tensor"),
                                                  ("block", "group")])
def test_fp8_inputs_take_the_one_call_with_the_python_layers_bits(
        weights, activations, dtype, tiny_qwen2_dir, tmp_path):
    """An FP8 checkpoint's projections round their inputs in the C++ step (per row, by a
    static scale, per group), with the bits of the Python layers' rounding."""
    from fp8_files import write_fp8

    path = write_fp8(tiny_qwen2_dir, tmp_path / "fp8", weights, activations)
    model = load_model(path, dtype, "cpu", select_backend("cpu"))
    assert model.decode_step is not None
    rows = min(model.decode_step.max_rows or 3, 3)
    steps = [[(rid, [10 + step + rid]) for rid in range(rows)] for step in range(4)]
    _assert_twins(model, PROMPT_IDS[:rows], steps)
    assert model.decode_step.num_steps == len(steps)
