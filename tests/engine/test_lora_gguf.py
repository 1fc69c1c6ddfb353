"""LoRA adapters on a model whose weights stay in GGUF blocks (the default model is one): the
adapters' deltas, in floats, join the quantized projections' outputs, and each request of a
mixed batch gets PEFT's greedy tokens on the file's dequantized weights (within vLLM's rule:
the activations are quantized too); decode steps with adapters run in one C++ call."""

from __future__ import annotations

import pytest
from engine_helpers import assert_idle_and_nothing_leaked, engine_greedy
from gguf_files import dequantized_model, write_gguf
from greedy import check_logprobs_close
from test_lora import LORA_FLAGS, PROMPTS, mixed_run, peft_greedy, requests_of

from actorlm.kernels.cpu import linear as cpu_linear
from actorlm.kernels.cpu.decode_step import DecodeStep


@pytest.fixture(scope="module")
def tiny_llama_q8(tiny_llama_dir, tmp_path_factory):
    return write_gguf(tiny_llama_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf", "Q8_0")


@pytest.mark.skipif(cpu_linear._kernel() is None,
                    reason="the fp32 panel GEMM needs AVX-512 or AVX2 and FMA, and a C++ "
                           "compiler")
def test_adapters_on_weights_in_blocks_give_pefts_tokens_in_one_call_steps(
        make_llm, tiny_llama_q8, tiny_llama_adapters, monkeypatch):
    calls = []  # (rows, whether the step had adapters, whether the one call ran it)
    one_call = DecodeStep.__call__
    monkeypatch.setattr(DecodeStep, "__call__", lambda step, x, *args: calls.append(
        (x.shape[0], args[3] is not None, (out := one_call(step, x, *args)) is not None))
        or out)
    llm = make_llm(str(tiny_llama_q8), **LORA_FLAGS)
    names = ["base", "alpha", "beta", "gamma"]
    by_name = mixed_run(llm, tiny_llama_adapters, names)
    for name, lora in requests_of(tiny_llama_adapters).items():
        expected = peft_greedy(None, None if lora is None else lora.lora_path, PROMPTS,
                               base=dequantized_model(tiny_llama_q8))
        check_logprobs_close(engine_greedy(by_name[name]), [(t, tops) for t, tops, _ in expected])
    with_adapters = [took for rows, lora, took in calls if lora and rows == len(names) * 3]
    assert with_adapters and all(with_adapters)  # every full decode step, in one call
    assert_idle_and_nothing_leaked(llm)
