"""Our paged CausalLM against transformers on the same checkpoint."""

from __future__ import annotations

import pytest
import torch

from paged_contexts import PagedContexts
from tolerance import assert_within, rounding_error, sum_error

from actorlm.kernels import select_backend
from actorlm.kernels.cpu.linear import PlainLinear
from actorlm.kernels.portable import apply_rope
from actorlm.kernels.reference import rms_norm_ref
from actorlm.models.layers import Linear, RMSNorm
from actorlm.models.loader import load_model

TINY = ["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir"]
PROMPTS = [
    "Once upon a time there was a small village",
    "The quick brown fox",
    "Machine learning models read text as tokens, one step at a time, until they write an answer.",
]


def _load_pair(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours = load_model(path, torch.float32, "cpu", select_backend("cpu"))
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    return ours, theirs, tokenizer


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()  # [L, V]


@pytest.mark.parametrize("checkpoint", TINY)
def test_prefill_logits_match_hf(checkpoint, request):
    ours, theirs, tokenizer = _load_pair(request.getfixturevalue(checkpoint))
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    logits = PagedContexts(ours).step(ours, list(enumerate(prompts)))
    assert logits.dtype == torch.float32 and logits.shape == (sum(map(len, prompts)), ours.vocab_size)
    for rows, ids in zip(logits.split([len(p) for p in prompts]), prompts):
        torch.testing.assert_close(rows, _hf_logits(theirs, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("checkpoint", TINY)
def test_two_stage_prefill_matches_hf(checkpoint, request):
    ours, theirs, tokenizer = _load_pair(request.getfixturevalue(checkpoint))
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    splits = [3, len(prompts[1]) - 1, 9]  # the second request's second stage is a single token
    cache = PagedContexts(ours, seed=1)
    cache.step(ours, [(rid, ids[:cut]) for rid, (ids, cut) in enumerate(zip(prompts, splits))])
    logits = cache.step(ours, [(rid, ids[cut:]) for rid, (ids, cut) in enumerate(zip(prompts, splits))])
    rows = logits.split([len(ids) - cut for ids, cut in zip(prompts, splits)])
    for got, ids, cut in zip(rows, prompts, splits):
        torch.testing.assert_close(got, _hf_logits(theirs, ids)[cut:], atol=1e-4, rtol=0)


@pytest.mark.parametrize("checkpoint", TINY)
def test_batched_greedy_decode_matches_hf_generate(checkpoint, request):
    ours, theirs, tokenizer = _load_pair(request.getfixturevalue(checkpoint))
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    num_steps = 12
    cache = PagedContexts(ours, seed=2)
    logits = cache.step(ours, list(enumerate(prompts)))
    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    outputs = [[t] for t in logits[last].argmax(-1).tolist()]
    for _ in range(num_steps - 1):
        logits = cache.step(ours, [(rid, out[-1:]) for rid, out in enumerate(outputs)])
        for out, token in zip(outputs, logits.argmax(-1).tolist()):
            out.append(token)
    for ids, out in zip(prompts, outputs):
        with torch.inference_mode():
            expected = theirs.generate(
                torch.tensor([ids]), max_new_tokens=num_steps, min_new_tokens=num_steps, do_sample=False
            )
        assert out == expected[0, len(ids) :].tolist()


@pytest.mark.slow
def test_smollm2_last_logits_match_hf(smollm2_dense_dir):
    ours, theirs, tokenizer = _load_pair(smollm2_dense_dir)
    texts = ["The capital of France is", "def fibonacci(n):", "Hello! How are you today? I am"]
    prompts = [tokenizer(t).input_ids for t in texts]
    logits = PagedContexts(ours, num_blocks=64, block_size=16).step(ours, list(enumerate(prompts)))
    last = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    for row, ids in zip(logits[last], prompts):
        expected = _hf_logits(theirs, ids)[-1]
        torch.testing.assert_close(row, expected, atol=1e-3, rtol=0)
        assert row.argmax() == expected.argmax()


@pytest.mark.parametrize(
    "rope_parameters",
    [
        {"rope_type": "default", "rope_theta": 500000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128,
        },
        {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
    ],
    ids=lambda p: p["rope_type"],
)  # fmt: skip
def test_rope_scaling_matches_hf(rope_parameters):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from actorlm.models.causal_lm import CausalLM

    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=32, max_position_embeddings=512, rope_parameters=dict(rope_parameters),
    )  # fmt: skip
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = CausalLM(config, select_backend("cpu"))
    positions = torch.arange(0, 500, 7)
    (cos, sin), = model.ropes(positions)  # [T, 1, D] each
    hf_cos, hf_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    torch.testing.assert_close(cos[:, 0], hf_cos[0], atol=0, rtol=0)
    q, k = torch.randn(2, len(positions), 4, 16).unbind()  # [T, H, D]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                      hf_cos, hf_sin)  # [1, H, T, D]
    torch.testing.assert_close(apply_rope(q, cos, sin), hf_q[0].transpose(0, 1), atol=0, rtol=0)
    torch.testing.assert_close(apply_rope(k, cos, sin), hf_k[0].transpose(0, 1), atol=0, rtol=0)


def test_bf16_model_packs_every_linear_and_tracks_transformers(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ours = load_model(tiny_llama_dir, torch.bfloat16, "cpu", select_backend("cpu"))
    linears = [m for m in ours.modules() if isinstance(m, Linear)]
    # the fast CPU path is on: every weight packed for oneDNN or the panel GEMM (oneDNN's bf16
    # GEMM needs AVX-512: without it bf16 layers run F.linear on their plain weights)
    assert linears
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert not any(isinstance(m.prepared, PlainLinear) for m in linears)
    theirs = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    logits = PagedContexts(ours).step(ours, list(enumerate(prompts)))
    for rows, ids in zip(logits.split([len(p) for p in prompts]), prompts):
        expected = _hf_logits(theirs, ids)
        # Logits reach ~10 here, where one bf16 ulp is 0.0625: allow 4 ulps of rounding-order
        # difference (transformers' own bf16 logits are up to 0.7 from its fp32 ones).
        torch.testing.assert_close(rows, expected, atol=0.25, rtol=0)
        assert torch.equal(rows.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norm_tracks_transformers(dtype):
    # HF's order: fp32 normalisation, cast, then the weight. The sum of squares runs in another
    # order here, so each side is held to the float64 oracle: the normed value is off by the
    # sum's error (half of it, through the square root) plus its rounding to the dtype, then
    # times |weight|, plus the product's rounding
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    theirs = LlamaRMSNorm(576, eps=1e-5).to(dtype)
    ours = RMSNorm(576, 1e-5, False, select_backend("cpu"), dtype, "cpu")
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(576, generator=gen))
        ours.weight.copy_(theirs.weight)
    for rows in (1, 5, 64):
        x = (3 * torch.randn(rows, 576, generator=gen)).to(dtype)
        expected = rms_norm_ref(x.double(), ours.weight.double(), 1e-5)  # unrounded
        normed = (expected / ours.weight.double()).abs()
        bound = (sum_error(576, 1.0) / 2 * normed + rounding_error(normed, dtype)) * \
            ours.weight.double().abs() + rounding_error(expected, dtype)
        for side in (ours(x), theirs(x)):
            assert_within(side, expected, bound, f"{dtype}, {rows} rows")
