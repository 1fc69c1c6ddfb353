"""Choosing the backend, what the door refuses rather than computing wrong, and what each wing
computes through it."""

from __future__ import annotations

import logging

import pytest
import torch

from actorlm.kernels import AttentionLayer, QuantizedWeight, select_backend
from actorlm.kernels.reference import bidirectional_attention_ref, write_kv_ref
from paged_batches import assert_matches_reference
from tolerance import assert_within, attention_error


def test_a_cpu_gets_the_cpu_backend_and_the_variable_overrides_it(monkeypatch):
    monkeypatch.delenv("ACTORLM_ATTENTION_BACKEND", raising=False)
    assert select_backend("cpu").name == "cpu"
    monkeypatch.setenv("ACTORLM_ATTENTION_BACKEND", "triton")
    assert select_backend("cpu").name == "triton"  # tests run under TRITON_INTERPRET=1


def test_the_former_name_of_the_cpu_backend_still_works_with_a_deprecation_line(monkeypatch,
                                                                                caplog):
    monkeypatch.setenv("ACTORLM_ATTENTION_BACKEND", "torch")
    with caplog.at_level(logging.WARNING, logger="actorlm.kernels"):
        assert select_backend("cpu").name == "cpu"
    assert "deprecated" in caplog.text and "cpu" in caplog.text


def test_an_unknown_backend_is_refused_naming_the_choices(monkeypatch):
    monkeypatch.setenv("ACTORLM_ATTENTION_BACKEND", "cuda-graphs")
    with pytest.raises(ValueError, match="cpu, triton"):
        select_backend("cpu")


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_formats_without_kernels_are_refused_by_name(name, monkeypatch):
    monkeypatch.setenv("ACTORLM_ATTENTION_BACKEND", name)
    backend = select_backend("cpu")
    weight = QuantizedWeight("Q2_K", torch.zeros(84, dtype=torch.uint8), (1, 256))
    with pytest.raises(NotImplementedError, match="Q2_K"):
        backend.prepare_linear(weight, None)


@pytest.mark.parametrize("name", ["cpu", "triton"])
def test_both_wings_attend_through_a_sliding_window_with_capped_scores(name, monkeypatch):
    # the door's whole attention (the K/V write, then attention) for a layer with a window and
    # a score cap, against the oracle's; RoPE by the identity (cos 1, sin 0)
    monkeypatch.setenv("ACTORLM_ATTENTION_BACKEND", name)
    backend = select_backend("cpu")
    layer = AttentionLayer(4, 2, 16, 0.25, window=5, softcap=2.0)
    # a chunk of 9 queries over 3 cached tokens, and a decode at position 13; blocks of 4
    q_lens, seq_lens, block_ids = [9, 1], [12, 14], [[3, 1, 5], [2, 6, 0, 4]]
    gen = torch.Generator().manual_seed(0)
    caches = tuple(torch.randn(7, 4, 2, 16, generator=gen) for _ in range(2))
    qkv = torch.randn(10, (4 + 2 * 2) * 16, generator=gen)
    meta = backend.attention_metadata(q_lens, seq_lens, block_ids, 4)
    expected_caches = tuple(c.clone() for c in caches)
    key, value = qkv[:, 64:96].view(10, 2, 16), qkv[:, 96:].view(10, 2, 16)
    write_kv_ref(key, value, *expected_caches, meta.slot_mapping)
    out = backend.attention(qkv.clone(), torch.ones(10, 1, 16), torch.zeros(10, 1, 16), caches,
                            meta, layer)
    assert torch.equal(caches[0], expected_caches[0]) and torch.equal(caches[1],
                                                                      expected_caches[1])
    inputs = (qkv[:, :64].reshape(10, 4, 16), *caches, meta.block_tables, meta.query_start_loc,
              meta.seq_lens)
    assert_matches_reference(out.view(10, 4, 16), inputs, 0.25, probs=torch.float32, window=5,
                             softcap=2.0)  # fp32 throughout


@pytest.mark.parametrize("name", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=["e4m3", "e5m2"])
def test_both_wings_store_fp8_caches_as_the_oracle_and_attend_over_them(name, dtype,
                                                                         cache_dtype,
                                                                         monkeypatch):
    # --kv-cache-dtype fp8: the door's K/V write rounds into the FP8 caches bit for bit as
    # the oracle's (values past E4M3's 448 saturate), and attention reads what they hold; a
    # chunk of 6 queries over 2 cached tokens and two decodes, blocks of 4
    monkeypatch.setenv("ACTORLM_ATTENTION_BACKEND", name)
    backend = select_backend("cpu")
    layer = AttentionLayer(4, 2, 16, 0.25)
    q_lens, seq_lens, block_ids = [6, 1, 1], [8, 5, 11], [[3, 1], [2, 6], [0, 4, 5]]
    gen = torch.Generator().manual_seed(3)
    caches = tuple((torch.randn(7, 4, 2, 16, generator=gen) * 4).to(cache_dtype)
                   for _ in range(2))
    qkv = (torch.randn(8, (4 + 2 * 2) * 16, generator=gen) * 4).to(dtype)
    qkv[0, 64] = qkv[1, 100] = 1000.0  # beyond E4M3's largest value, 448
    meta = backend.attention_metadata(q_lens, seq_lens, block_ids, 4)
    expected = tuple(c.clone() for c in caches)
    key, value = qkv[:, 64:96].view(8, 2, 16), qkv[:, 96:].view(8, 2, 16)
    write_kv_ref(key, value, *expected, meta.slot_mapping)
    out = backend.attention(qkv.clone(), torch.ones(8, 1, 16, dtype=dtype),
                            torch.zeros(8, 1, 16, dtype=dtype), caches, meta, layer)
    for cache, want in zip(caches, expected):
        assert cache.dtype == cache_dtype and torch.equal(cache.view(torch.uint8),
                                                          want.view(torch.uint8))
    written = caches[0].view(-1, 2, 16)[meta.slot_mapping]  # (the rounding did happen)
    assert not torch.equal(written.to(dtype), key) and written.float().isfinite().all()
    inputs = (qkv[:, :64].reshape(8, 4, 16), *caches, meta.block_tables, meta.query_start_loc,
              meta.seq_lens)
    assert_matches_reference(out.view(8, 4, 16), inputs, 0.25,
                             probs=None if dtype == torch.float32 else dtype)


@pytest.mark.parametrize("name", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_wings_attend_both_ways_within_each_request(name, dtype, monkeypatch):
    # an encoder's attention: three requests' rows (5, 1 and 9), each seeing all of its own
    # rows and none of the others'; 4 query heads over 2 KV heads
    monkeypatch.setenv("ACTORLM_ATTENTION_BACKEND", name)
    backend = select_backend("cpu")
    layer, starts = AttentionLayer(4, 2, 16, 0.25), [0, 5, 6, 15]
    qkv = torch.randn(15, (4 + 2 * 2) * 16, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = backend.bidirectional_attention(qkv, starts, layer).view(15, 4, 16)
    q, k, v = qkv[:, :64].view(15, 4, 16), qkv[:, 64:96].view(15, 2, 16), qkv[:, 96:].view(15, 2, 16)
    want = bidirectional_attention_ref(q, k, v, starts, 0.25)
    low = None if dtype == torch.float32 else dtype
    for begin, end in zip(starts, starts[1:]):
        keys, values = (t[begin:end].repeat_interleave(2, dim=1) for t in (k, v))
        bound = attention_error(q[begin:end], keys, values, 0.25,
                                torch.ones(end - begin, end - begin, dtype=torch.bool),
                                want[begin:end], probs=low, output=low)
        assert_within(out[begin:end], want[begin:end], bound, f"rows {begin}:{end}")
    # a request's rows read nobody else's: the first request's output alone is the same
    alone = backend.bidirectional_attention(qkv[:5].clone(), [0, 5], layer).view(5, 4, 16)
    assert torch.equal(alone, out[:5])
    # a bias on the scores (MPNet's relative positions), each request's of its own length
    table = torch.randn(4, 9, 9, generator=torch.Generator().manual_seed(2))
    bias = lambda n: table[:, :n, :n]  # noqa: E731
    biased = backend.bidirectional_attention(qkv, starts, layer, bias).view(15, 4, 16)
    want = bidirectional_attention_ref(q, k, v, starts, 0.25, bias)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(biased.float(), want.float(), atol=tolerance, rtol=tolerance)
    assert (biased.float() - out.float()).abs().max() > 0.1
    # a window (ModernBERT's local layers): keys at most 2 positions away, either side
    local = AttentionLayer(4, 2, 16, 0.25, window=2)
    windowed = backend.bidirectional_attention(qkv, starts, local).view(15, 4, 16)
    want = bidirectional_attention_ref(q, k, v, starts, 0.25, window=2)
    torch.testing.assert_close(windowed.float(), want.float(), atol=tolerance, rtol=tolerance)
    assert (windowed.float() - out.float())[6:].abs().max() > 0.1  # (the 9-row request's)


@pytest.mark.parametrize("name", ["cpu", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_embedding_in_blocks_looks_up_gguf_dequantized_rows(name, dtype, monkeypatch):
    import gguf

    monkeypatch.setenv("ACTORLM_ATTENTION_BACKEND", name)
    table = torch.randn(10, 64)
    blocks = gguf.quants.quantize(table.numpy(), gguf.GGMLQuantizationType.Q8_0)
    weight = QuantizedWeight("Q8_0", torch.from_numpy(blocks), (10, 64))
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q8_0))
    ids = torch.tensor([3, 0, 9, 3])
    rows = select_backend("cpu").prepare_embedding(weight, dtype)(ids)
    assert rows.dtype == dtype
    torch.testing.assert_close(rows, expected[ids].to(dtype), atol=0, rtol=0)  # exact: d * q
