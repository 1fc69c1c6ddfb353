"""LoRA adapters under tensor parallelism (TP=2 over worker processes, gloo): each rank holds
its share of every adapter as of its base layers (B's rows of its q/k/v heads and of its half
of gate/up; A's columns of its o_proj and down_proj inputs, whose partial deltas the layer's
all-reduce sums), and a mixed batch over three adapters and the base model gives TP=1's greedy
tokens, also where both ranks hold a copy of the one KV head."""

from __future__ import annotations

import pytest
from checkpoints import _common, _save_tiny
from lora_adapters import make_adapter
from test_lora import LORA_FLAGS, NUM_TOKENS, PROMPTS, requests_of

from actorlm import SamplingParams
from actorlm.config import EngineConfig

NAMES = ["base", "alpha", "beta", "gamma"]


@pytest.fixture(scope="module")
def replicated_kv(tmp_path_factory, tiny_tokenizer_dir):
    """A Llama of 4 query heads and 1 KV head (each of 2 ranks holds a copy of it, and so the
    same rows of the adapters' k and v), biases on o_proj and down_proj (added once, after the
    reduce that sums the ranks' deltas), and two adapters of it: (model, name -> adapter)."""
    from transformers import LlamaConfig

    config = LlamaConfig(**{**_common(tiny_tokenizer_dir), "num_key_value_heads": 1},
                         tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
                         rope_theta=10000.0)
    model = _save_tiny(tmp_path_factory, tiny_tokenizer_dir, "tiny_lora_kv1", config, seed=4)
    adapters = {}
    for seed, (name, r) in enumerate({"alpha": 4, "beta": 8, "gamma": 16}.items()):
        adapters[name] = tmp_path_factory.mktemp(f"lora_kv1_{name}")
        make_adapter(model, adapters[name], seed=20 + seed, r=r)
    return model, adapters


def _greedy(llm, adapters) -> dict[str, list[list[int]]]:
    """Every prompt under each of NAMES, in one batch -> name -> each prompt's tokens."""
    loras = requests_of(adapters)
    batch = [(name, p) for name in NAMES for p in PROMPTS]
    params = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for _, p in batch], params, use_tqdm=False,
                           lora_request=[loras[name] for name, _ in batch])
    tokens: dict[str, list[list[int]]] = {}
    for (name, _), output in zip(batch, outputs):
        tokens.setdefault(name, []).append(list(output.outputs[0].token_ids))
    return tokens


def _assert_tp2_gives_tp1s_tokens(make_llm, model_dir, adapters) -> None:
    expected = _greedy(make_llm(str(model_dir), **LORA_FLAGS), adapters)
    assert len({str(tokens) for tokens in expected.values()}) == len(NAMES)  # they differ
    tp2 = make_llm(str(model_dir), **LORA_FLAGS, tensor_parallel_size=2,
                   distributed_executor_backend="mp")
    assert _greedy(tp2, adapters) == expected


def test_tp2_mixed_adapters_give_tp1s_tokens(make_llm, tiny_llama_dir, tiny_llama_adapters):
    _assert_tp2_gives_tp1s_tokens(make_llm, tiny_llama_dir, tiny_llama_adapters)


def test_tp2_with_a_replicated_kv_head_and_biases_gives_tp1s_tokens(make_llm, replicated_kv):
    _assert_tp2_gives_tp1s_tokens(make_llm, *replicated_kv)


def test_lora_with_tensor_parallelism_is_accepted():
    config = EngineConfig(enable_lora=True, tensor_parallel_size=2,
                          distributed_executor_backend="mp")
    assert config.enable_lora and config.tensor_parallel_size == 2
