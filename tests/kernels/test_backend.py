"""Choosing the backend, and what the door refuses rather than computing wrong."""

from __future__ import annotations

import logging

import pytest
import torch

from actorlm.kernels import AttentionLayer, QuantizedWeight, select_backend


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
def test_formats_without_kernels_and_sliding_windows_are_refused_by_name(name, monkeypatch):
    monkeypatch.setenv("ACTORLM_ATTENTION_BACKEND", name)
    backend = select_backend("cpu")
    weight = QuantizedWeight("Q2_K", torch.zeros(84, dtype=torch.uint8), (1, 256))
    with pytest.raises(NotImplementedError, match="Q2_K"):
        backend.prepare_linear(weight, None)
    layer = AttentionLayer(2, 1, 16, 0.25, window=64)
    qkv = torch.randn(1, 4 * 16)
    caches = (torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16))
    meta = backend.attention_metadata([1], [1], [[0]], 4)
    with pytest.raises(NotImplementedError, match="window 64"):
        backend.attention(qkv, torch.ones(1, 1, 16), torch.zeros(1, 1, 16), caches, meta, layer)
    assert not caches[0].any()  # nothing was written


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
