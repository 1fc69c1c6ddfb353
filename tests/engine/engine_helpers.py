"""Oracles and checks shared by the engine tests."""

import torch
from greedy import TOP, check_logprobs_close, hf_continuation  # noqa: F401  (the oracle rule)
from processes import live_children  # noqa: F401  (the process tests' check)
from transformers import AutoModelForCausalLM

# what the process tests (worker processes, engine-core processes, replicas) generate
PROMPTS = ["Once upon a time", "The capital of France is", "1, 2, 3,", "def fibonacci(n):"]


def hf_greedy(model_dir, prompts: list[list[int]], num_tokens: int) -> list[tuple[list, list]]:
    """transformers' own greedy decoding (KV cache on, EOS ignored), one prompt at a time:
    per prompt, (tokens, the top-5 token ids at each position)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return [hf_continuation(model, prompt, num_tokens) for prompt in prompts]


def engine_greedy(outputs) -> list[tuple[list, list]]:
    """The engine's outputs (asked with ``logprobs=5``) in ``hf_greedy``'s shape."""
    return [(o.outputs[0].token_ids, [set(position) for position in o.outputs[0].logprobs])
            for o in outputs]


def assert_idle_and_nothing_leaked(llm) -> dict:
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert stats["num_requests_holding_blocks"] == 0
    return stats


def undisturbed_tokens(model_dir, prompts: list[str], params, **flags) -> list[list[int]]:
    """The full-length greedy tokens of an in-process engine, the reference of a run that a
    death interrupts."""
    from actorlm.llm import LLM

    with LLM(str(model_dir), **flags) as llm:
        return full_length_tokens(llm.generate(prompts, params, use_tqdm=False))


def full_length_tokens(outputs) -> list[list[int]]:
    """Each output's tokens, every one of which must have run to its max_tokens."""
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)
    return [o.outputs[0].token_ids for o in outputs]
