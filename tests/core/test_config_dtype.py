"""--dtype auto picks what the hardware computes fastest, whatever the checkpoint declares."""

from types import SimpleNamespace

import pytest
import torch

from actorlm import config
from actorlm.config import EngineConfig


@pytest.mark.parametrize("native_bf16,expected", [(True, torch.bfloat16), (False, torch.float32)])
@pytest.mark.parametrize("declared", ["float32", "bfloat16", "float16", None])
def test_auto_on_a_cpu_follows_native_bf16(monkeypatch, native_bf16, expected, declared):
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native_bf16)
    hf_config = SimpleNamespace(dtype=declared)
    assert EngineConfig(device="cpu").torch_dtype(hf_config) is expected


@pytest.mark.parametrize("declared,expected", [("float16", torch.float16), ("float32", torch.bfloat16),
                                               (torch.bfloat16, torch.bfloat16), (None, torch.bfloat16)])
def test_auto_on_a_gpu_keeps_a_half_precision_checkpoint(declared, expected):
    assert EngineConfig(device="cuda").torch_dtype(SimpleNamespace(dtype=declared)) is expected


def test_an_explicit_dtype_wins(monkeypatch):
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: True)
    assert EngineConfig(device="cpu", dtype="fp32").torch_dtype() is torch.float32


def test_native_bf16_detection_answers_a_bool():
    assert isinstance(config.cpu_has_native_bf16(), bool)


@pytest.mark.parametrize("flag", ["enable_prefix_caching", "enable_chunked_prefill"])
def test_a_switch_must_be_a_bool(flag):
    from actorlm.config import EngineConfig

    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} must be true or false"):
        EngineConfig(**{flag: "maybe"})


@pytest.mark.parametrize("value", [True, 0, -1, "2", 2.0])
@pytest.mark.parametrize("flag", ["tensor_parallel_size", "max_num_seqs"])
def test_a_count_must_be_a_positive_integer(flag, value):
    with pytest.raises(ValueError, match=f"--{flag.replace('_', '-')} must be a positive integer"):
        EngineConfig(**{flag: value})


@pytest.mark.parametrize("value", ["MP", "threads", 5, ["mp"]])
def test_an_executor_backend_must_be_one_of_the_three(value):
    with pytest.raises(ValueError, match="--distributed-executor-backend must be one of uni, mp, ray"):
        EngineConfig(distributed_executor_backend=value)
    with pytest.raises(ValueError, match="uni runs one rank"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="uni")


@pytest.mark.parametrize("fields, said", [
    ({"kv_cache_dtype": "int8"}, "--kv-cache-dtype 'int8' is not implemented"),
    ({"tokenizer_mode": "mistral"}, "--tokenizer-mode 'mistral' is not implemented"),
    ({"tokenizer_mode": "slow"}, "--tokenizer-mode 'slow' is not implemented"),
    ({"load_format": "dummy"}, "--load-format 'dummy' is not implemented"),
    ({"load_format": "pt", "model": "/m"}, "--load-format 'pt' is not implemented"),
    ({"load_format": "gguf", "model": "/m"}, "--load-format gguf: the model is not a GGUF"),
    ({"load_format": "safetensors", "model": "/m.gguf"}, "the model is a GGUF file"),
    ({"load_format": "safetensors"}, "the model is a GGUF file")])
def test_a_vllm_choice_this_engine_does_not_compute_is_refused_by_name(fields, said):
    with pytest.raises(ValueError, match=said):
        EngineConfig(**fields)
    assert EngineConfig(kv_cache_dtype="auto", tokenizer_mode="hf").tokenizer_mode == "hf"
    assert EngineConfig(model="/m", load_format="safetensors").load_format == "safetensors"
    assert EngineConfig(load_format="gguf").load_format == "gguf"
