"""Embeddings from a pooling model, against sentence-transformers on the same directory.

The oracle is sentence-transformers' own ``encode`` (its Transformer module runs the decoder in
transformers, then its Pooling and Normalize modules); the directories are written by it
(``tests/embedding_models.py``). Prompts of several lengths, prefilled in chunks of 16 tokens,
so that a mean or a first token's state crosses steps.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from actorlm import LLM, PoolingParams, SamplingParams
from actorlm.pooling import NOTHING_SAMPLED, PoolerConfig, pooler_config

PROMPTS = ["The quick brown fox", "Once upon a time there was a small village at the edge of a "
           "great forest, and in that village lived an old baker who rose every morning.",
           "Questions and answers, numbers like 1, 2, 3, 42 and 2024."]
FLAGS = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16, max_num_seqs=4)


def _oracle(path, prompts=PROMPTS) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(path), device="cpu")
    return model.encode(prompts, convert_to_tensor=True).float().cpu()


def _vectors(outputs) -> torch.Tensor:
    assert all(o.finished and o.error is None for o in outputs)
    return torch.tensor([o.outputs.embedding for o in outputs])


@pytest.fixture(scope="module")
def oracles(tiny_embedding_dirs):
    return {name: _oracle(path) for name, path in tiny_embedding_dirs.items()}


@pytest.mark.parametrize("name", ["qwen3_last", "llama_mean", "qwen3_cls", "qwen3_last_raw"])
def test_embeddings_match_sentence_transformers(name, tiny_embedding_dirs, oracles):
    with LLM(str(tiny_embedding_dirs[name]), **FLAGS) as llm:
        assert llm.config.is_pooling  # a bare Qwen3Model / LlamaModel checkpoint: auto
        outputs = llm.embed(PROMPTS, use_tqdm=False)
        encoded = llm.encode(PROMPTS[:2], use_tqdm=False)  # vLLM's generic call: the same
        stats = llm.stats()
    got, want = _vectors(outputs), oracles[name]
    torch.testing.assert_close(torch.stack([o.outputs.data for o in encoded]), want[:2],
                               atol=2e-6, rtol=1e-5)
    assert [o.prompt_token_ids for o in outputs] == [llm.tokenizer.encode(p) for p in PROMPTS]
    assert max(len(o.prompt_token_ids) for o in outputs) > 16  # crossed steps
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert (got.norm(dim=-1) - 1).abs().max() < 1e-5 if name != "qwen3_last_raw" else \
        (got.norm(dim=-1) - 1).abs().min() > 0.01
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_requests_holding_blocks"] == 0  # every request's blocks went back


def test_pooling_of_another_kind_differs(tiny_embedding_dirs, oracles):
    """The three poolings of one decoder's states are three different vectors: the tests
    above would see a pooling swapped for another."""
    assert (oracles["qwen3_last"] - oracles["qwen3_cls"]).abs().max() > 0.1
    with LLM(str(tiny_embedding_dirs["qwen3_last"]), pooler_config={"pooling_type": "mean"},
             **FLAGS) as llm:
        mean = _vectors(llm.embed(PROMPTS, use_tqdm=False))
    # --pooler-config over the directory's last-token pooling: the same decoder's mean
    transformer = _raw_states(tiny_embedding_dirs["qwen3_last"], PROMPTS)
    want = torch.stack([torch.nn.functional.normalize(s.mean(0), dim=-1) for s in transformer])
    torch.testing.assert_close(mean, want, atol=2e-6, rtol=1e-5)
    assert (mean - oracles["qwen3_last"]).abs().max() > 0.1


def _raw_states(path, prompts) -> list[torch.Tensor]:
    """transformers' final hidden states of each prompt, alone (no padding)."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path)
    with torch.no_grad():
        return [model(torch.tensor([tokenizer.encode(p)])).last_hidden_state[0].float()
                for p in prompts]


def test_bf16_embeddings_close_to_fp32_oracle(tiny_embedding_dirs, oracles):
    with LLM(str(tiny_embedding_dirs["qwen3_last"]), **{**FLAGS, "dtype": "bfloat16"}) as llm:
        got = _vectors(llm.embed(PROMPTS, use_tqdm=False))
    cosine = torch.nn.functional.cosine_similarity(got, oracles["qwen3_last"])
    assert cosine.min() > 0.999, cosine


def test_prefix_cache_serves_last_token_pooling(tiny_embedding_dirs, oracles):
    """Last-token pooling keeps prefix caching (the last token is always computed): a prompt
    seen before is served from the cache and pools to the same vector; mean pooling turns the
    cache off (it needs every token's state)."""
    path = tiny_embedding_dirs["qwen3_last"]
    with LLM(str(path), **{**FLAGS, "max_num_batched_tokens": 64}) as llm:
        assert llm.config.enable_prefix_caching
        first = llm.embed(PROMPTS[1], use_tqdm=False)[0]
        again = llm.embed(PROMPTS[1], use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 16
    torch.testing.assert_close(_vectors([again]), oracles["qwen3_last"][1:2], atol=2e-6,
                               rtol=1e-5)
    with LLM(str(tiny_embedding_dirs["llama_mean"]), **FLAGS) as llm:
        assert not llm.config.enable_prefix_caching


def test_embeddings_recomputed_after_a_worker_fault(tiny_embedding_dirs, oracles):
    """A step that faults mid-prompt: the worker is replaced (its partial sums with it) and
    every running request recomputed from its first token, so a mean pooled over chunks
    starts again from nothing and comes out the same."""
    import queue

    from actorlm.actors.system import EngineSystem
    from actorlm.config import EngineConfig
    from actorlm.messages import SubmitRequest
    from actorlm.testing import FaultInjector

    faults = FaultInjector()
    faults.raise_at(2)  # the long prompt is two chunks in
    engine = EngineSystem(EngineConfig.from_flags(str(tiny_embedding_dirs["llama_mean"]),
                                                  **FLAGS), wrap_runner=faults.wrap)
    try:
        sink = queue.Queue()
        for i, prompt in enumerate(PROMPTS):
            engine.frontend.ask(SubmitRequest(str(i), prompt, NOTHING_SAMPLED, sink,
                                              pooling_params=PoolingParams()))
        outputs = sorted((sink.get(timeout=60) for _ in PROMPTS), key=lambda o: o.request_id)
        stats = engine.stats()
    finally:
        engine.stop()
    assert faults.faulted_steps == [2] and stats["num_worker_restarts"] == 1
    torch.testing.assert_close(_vectors(outputs), oracles["llama_mean"], atol=2e-6, rtol=1e-5)


def test_request_pooling_params(tiny_embedding_dirs):
    """normalize per request; Matryoshka dimensions: the first ones, then normalized if asked
    (vLLM's order), only where the model says it was trained for them."""
    raw = _oracle(tiny_embedding_dirs["qwen3_last_raw"])
    with LLM(str(tiny_embedding_dirs["qwen3_last_raw"]), **FLAGS) as llm:
        normed = _vectors(llm.embed(PROMPTS, PoolingParams(normalize=True), use_tqdm=False))
        short = _vectors(llm.embed(PROMPTS, PoolingParams(dimensions=16), use_tqdm=False))
        short_normed = _vectors(llm.embed(PROMPTS, PoolingParams(dimensions=16, normalize=True),
                                          use_tqdm=False))
        with pytest.raises(ValueError, match="dimensions: at most the model's 64"):
            llm.embed(PROMPTS[0], PoolingParams(dimensions=65))
    torch.testing.assert_close(normed, torch.nn.functional.normalize(raw, dim=-1), atol=2e-6,
                               rtol=1e-5)
    torch.testing.assert_close(short, raw[:, :16], atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(short_normed, torch.nn.functional.normalize(raw[:, :16], dim=-1),
                               atol=2e-6, rtol=1e-5)
    with LLM(str(tiny_embedding_dirs["qwen3_last"]), **FLAGS) as llm:
        with pytest.raises(ValueError, match="does not support matryoshka"):
            llm.embed(PROMPTS[0], PoolingParams(dimensions=16))
        with pytest.raises(ValueError, match="does not generate"):
            llm.generate(PROMPTS[0], SamplingParams(max_tokens=2))
        assert _vectors(llm.embed(PROMPTS[0], use_tqdm=False)).shape == (1, 64)  # still serving
    with pytest.raises(ValueError, match="dimensions: must be a positive integer"):
        PoolingParams(dimensions=0)


def test_generating_model_refuses_embeddings_and_runs_pooling_on_request(tiny_qwen3_dir):
    with LLM(str(tiny_qwen3_dir), **FLAGS) as llm:
        assert not llm.config.is_pooling
        with pytest.raises(ValueError, match="embeddings need a pooling model"):
            llm.embed(PROMPTS[0])
    # a causal LM embedded on request (vLLM's --runner pooling): its last token's state
    with LLM(str(tiny_qwen3_dir), runner="pooling", **FLAGS) as llm:
        got = _vectors(llm.embed(PROMPTS, use_tqdm=False))
    want = torch.stack([torch.nn.functional.normalize(s[-1], dim=-1)
                        for s in _raw_states(tiny_qwen3_dir, PROMPTS)])
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("flags", [{"engine_core_process": True}, {"tensor_parallel_size": 2}],
                         ids=["engine_core_process", "tp2"])
def test_embeds_across_processes(flags, tiny_embedding_dirs, oracles):
    """The engine core in a process of its own (the server's layout), and two tensor-parallel
    ranks (each holds the whole hidden state after its all-reduce; rank 0 pools)."""
    with LLM(str(tiny_embedding_dirs["llama_mean"]), **flags, **FLAGS) as llm:
        got = _vectors(llm.embed(PROMPTS, use_tqdm=False))
    torch.testing.assert_close(got, oracles["llama_mean"], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("flags, message", [
    ({"pooler_config": {"pooling_type": "max"}}, "pooling_type 'MAX' is not implemented"),
    ({"pooler_config": {"dimensions": 8}}, "dimensions not implemented"),
    ({"pooler_config": "{not json"}, "not JSON"),
    ({"runner": "embedding"}, "--runner must be one of"),
    ({"task": "classify"}, "--task 'classify' is not implemented"),
    ({"runner": "generate", "convert": "embed"}, "contradicts"),
])
def test_bad_pooling_flags_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        LLM("unused", **flags)


def test_pooling_refuses_what_it_does_not_combine_with(tiny_embedding_dirs, tiny_qwen3_dir):
    path = str(tiny_embedding_dirs["qwen3_last"])
    with pytest.raises(ValueError, match="--enable-lora with a pooling model"):
        LLM(path, enable_lora=True, **FLAGS)
    with pytest.raises(ValueError, match="--speculative-config with a pooling model"):
        LLM(path, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                      "prompt_lookup_max": 2}, **FLAGS)
    with pytest.raises(ValueError, match="--pooler-config applies to a pooling model"):
        LLM(str(tiny_qwen3_dir), pooler_config={"pooling_type": "MEAN"}, **FLAGS)


def test_sentence_transformers_files(tiny_embedding_dirs, tmp_path):
    """The files of both generations of sentence-transformers (before v6, as the embedding
    models on the hub ship: ``pooling_mode_lasttoken: true`` under
    ``sentence_transformers.models.Pooling``); a module that would change the vector after
    pooling, or a pooling mode not implemented, is refused by name."""
    config = type("Config", (), {})()
    assert pooler_config(tiny_embedding_dirs["llama_mean"], config, None) == \
        PoolerConfig(pooling_type="MEAN", normalize=True, task="embed")
    old = tmp_path / "old"
    (old / "1_Pooling").mkdir(parents=True)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    (old / "modules.json").write_text(json.dumps(modules))
    flags = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
             "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
             "pooling_mode_lasttoken": True, "include_prompt": True}
    (old / "1_Pooling" / "config.json").write_text(json.dumps(flags))
    assert pooler_config(old, config, None) == \
        PoolerConfig(pooling_type="LAST", normalize=False, task="embed")
    assert pooler_config(old, config, PoolerConfig(normalize=True)).normalize is True
    (old / "1_Pooling" / "config.json").write_text(json.dumps(
        {**flags, "pooling_mode_lasttoken": False, "pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match=r"pooling \['max_tokens'\] is not implemented"):
        pooler_config(old, config, None)
    # a Dense module after the pooling is read (an encoder's test runs one); what else would
    # change the vector is refused by name: another module, a Dense before the pooling (it
    # would project every token), an activation or a residual not implemented
    dense = tmp_path / "dense"
    shutil.copytree(old, dense)
    (dense / "1_Pooling" / "config.json").write_text(json.dumps(flags))
    (dense / "2_Dense").mkdir()
    dense_config = {"in_features": 64, "out_features": 32, "bias": True,
                    "activation_function": "torch.nn.modules.activation.Tanh"}
    (dense / "2_Dense" / "config.json").write_text(json.dumps(dense_config))
    dense_module = {"idx": 2, "name": "2", "path": "2_Dense",
                    "type": "sentence_transformers.models.Dense"}
    for extra, refusal in (([dense_module], None),
                           ([{**dense_module, "type": "sentence_transformers.models.LayerNorm"}],
                            r"module\(s\) \['LayerNorm'\] are not implemented"),
                           ("before", r"a Dense module is implemented after the pooling")):
        listed = [modules[0], dense_module, modules[1]] if extra == "before" else \
            modules + extra
        (dense / "modules.json").write_text(json.dumps(listed))
        if refusal is None:
            assert [p.out_features for p in pooler_config(dense, config, None).projections] == [32]
            continue
        with pytest.raises(ValueError, match=refusal):
            pooler_config(dense, config, None)
    (dense / "modules.json").write_text(json.dumps(modules + [dense_module]))
    for field, value in (("activation_function", "torch.nn.modules.activation.Softplus"),
                         ("use_residual", True)):
        (dense / "2_Dense" / "config.json").write_text(json.dumps({**dense_config,
                                                                   field: value}))
        with pytest.raises(ValueError, match="Softplus is not implemented|use_residual"):
            pooler_config(dense, config, None)


def test_embedding_run_replays(tiny_embedding_dirs, tmp_path):
    """A traced run of embeddings replays step for step (the scheduler's decisions and the
    KV blocks: an embedding request ends in the step that completes its prompt)."""
    from actorlm.trace import read_jsonl, replay_trace

    trace = tmp_path / "trace.jsonl"
    with LLM(str(tiny_embedding_dirs["qwen3_last"]), trace_file=str(trace), **FLAGS) as llm:
        llm.embed(PROMPTS * 2, use_tqdm=False)
    report = replay_trace(read_jsonl(trace))
    assert report.matched and report.num_steps > 3, report


def test_gguf_embedding_model(tiny_qwen3_dir, oracles, tmp_path):
    """A GGUF file whose metadata says how it pools (llama.cpp writes ``qwen3.pooling_type``
    for Qwen3-Embedding's) runs as a pooling model by itself, normalized as llama.cpp does;
    a reranker's pooling is refused by name. (The prompts go in as the checkpoint's token
    ids: the file's tokenizer, rebuilt from its metadata, splits digits one by one where the
    tiny tokenizer does not.)"""
    import gguf
    from gguf_files import write_gguf
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_dir)
    prompts = [{"prompt_token_ids": tokenizer.encode(p)} for p in PROMPTS]

    path = write_gguf(tiny_qwen3_dir, tmp_path / "embed.gguf", "F32",
                      pooling_type=gguf.PoolingType.LAST)
    with LLM(str(path), **FLAGS) as llm:
        assert llm.config.is_pooling and llm.config.pooler_config.pooling_type == "LAST"
        got = _vectors(llm.embed(prompts, use_tqdm=False))
    torch.testing.assert_close(got, oracles["qwen3_last"], atol=2e-6, rtol=1e-5)
    rank = write_gguf(tiny_qwen3_dir, tmp_path / "rank.gguf", "F32",
                      pooling_type=gguf.PoolingType.RANK)
    with pytest.raises(ValueError, match="pooling_type 4 is not implemented"):
        LLM(str(rank), **FLAGS)


def test_hf_overrides_reach_the_frontend_and_the_workers(tiny_embedding_dirs, oracles):
    """vLLM's --hf-overrides: {"is_matryoshka": true} lets a request ask for dimensions (the
    frontend's check, in the server's process beside an engine-core process); an override
    that changes the math (rms_norm_eps) is what a worker process computes with, as
    transformers does with the same config."""
    from transformers import AutoConfig

    path = tiny_embedding_dirs["qwen3_last"]
    with LLM(str(path), hf_overrides='{"is_matryoshka": true}', engine_core_process=True,
             **FLAGS) as llm:
        short = _vectors(llm.embed(PROMPTS, PoolingParams(dimensions=16), use_tqdm=False))
    torch.testing.assert_close(
        short, torch.nn.functional.normalize(oracles["qwen3_last"][:, :16], dim=-1),
        atol=2e-6, rtol=1e-5)
    with LLM(str(path), hf_overrides={"rms_norm_eps": 0.5}, distributed_executor_backend="mp",
             **FLAGS) as llm:
        got = _vectors(llm.embed(PROMPTS, use_tqdm=False))
    from transformers import AutoModel, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    config.rms_norm_eps = 0.5
    model, tokenizer = AutoModel.from_pretrained(path, config=config), \
        AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        want = torch.stack([torch.nn.functional.normalize(
            model(torch.tensor([tokenizer.encode(p)])).last_hidden_state[0, -1], dim=-1)
            for p in PROMPTS])
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    assert (got - oracles["qwen3_last"]).abs().max() > 0.01  # the override changed the math
    with pytest.raises(ValueError, match="--hf-overrides: model_type cannot be overridden"):
        LLM(str(path), hf_overrides={"model_type": "llama"})
