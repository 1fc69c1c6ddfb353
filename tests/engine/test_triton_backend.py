"""The whole engine on the Triton kernels (CPU interpreter) gives the CPU backend's tokens."""

import pytest

from actorlm import SamplingParams
from actorlm.llm import LLM

PROMPTS = [[5, 17, 33, 8, 91, 4, 60], [12, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52],
           [200, 3, 150]]


def run(model_dir, monkeypatch, backend, params, **flags):
    monkeypatch.setenv("ACTORLM_ATTENTION_BACKEND", backend)
    # a small pool and a small token budget: chunked prefills mixed with decodes, and preemption
    with LLM(str(model_dir), dtype="float32", block_size=4, num_kv_blocks=12, max_model_len=32,
             max_num_batched_tokens=10, **flags) as llm:
        assert llm.engine.backend_name == backend
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"]
    return [o.outputs[0].token_ids for o in outputs], stats


@pytest.mark.slow
def test_triton_backend_matches_cpu_backend(tiny_llama_dir, monkeypatch):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cpu_tokens, cpu_stats = run(tiny_llama_dir, monkeypatch, "cpu", greedy)
    triton_tokens, triton_stats = run(tiny_llama_dir, monkeypatch, "triton", greedy)
    assert triton_tokens == cpu_tokens
    assert cpu_stats["num_preemptions"] > 0 and triton_stats["num_preemptions"] > 0


@pytest.mark.slow
def test_both_backends_round_into_an_fp8_kv_cache_alike(tiny_llama_dir, monkeypatch):
    # the same bits in the cache (both round as the oracle), so the same greedy tokens
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cpu_tokens, _ = run(tiny_llama_dir, monkeypatch, "cpu", greedy, kv_cache_dtype="fp8")
    triton_tokens, stats = run(tiny_llama_dir, monkeypatch, "triton", greedy,
                               kv_cache_dtype="fp8")
    assert triton_tokens == cpu_tokens and stats["num_preemptions"] > 0


@pytest.mark.slow
def test_logit_processing_is_shared_by_both_backends(tiny_llama_dir, monkeypatch):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                            repetition_penalty=1.4, frequency_penalty=0.5, logit_bias={9: 3.0})
    cpu_tokens, _ = run(tiny_llama_dir, monkeypatch, "cpu", params)
    triton_tokens, _ = run(tiny_llama_dir, monkeypatch, "triton", params)
    assert triton_tokens == cpu_tokens


@pytest.mark.slow
def test_the_triton_sampler_draws_in_the_engine_and_honours_seeds(tiny_llama_dir, monkeypatch):
    # temperature > 0, so the Triton sampling kernel runs: a seeded request draws the same
    # tokens in another run (recomputed after preemption alike), and they are not greedy's
    sampled = SamplingParams(max_tokens=12, temperature=1.5, top_k=50, seed=3, ignore_eos=True)
    first, _ = run(tiny_llama_dir, monkeypatch, "triton", sampled)
    again, _ = run(tiny_llama_dir, monkeypatch, "triton", sampled)
    greedy, _ = run(tiny_llama_dir, monkeypatch, "cpu",
                    SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    assert first == again and first != greedy


@pytest.mark.slow
def test_an_fp8_checkpoint_rounds_its_inputs_on_the_triton_backend_too(tiny_llama_dir,
                                                                      monkeypatch, tmp_path):
    from fp8_files import write_fp8

    path = write_fp8(tiny_llama_dir, tmp_path / "fp8", "block", "group")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cpu_tokens, _ = run(path, monkeypatch, "cpu", greedy)
    triton_tokens, _ = run(path, monkeypatch, "triton", greedy)
    assert triton_tokens == cpu_tokens
