"""Oracles and checks shared by the engine tests."""

import torch
from transformers import AutoModelForCausalLM


TOP = 5  # vLLM's check_logprobs_close looks at the top 5


def hf_greedy(model_dir, prompts: list[list[int]], num_tokens: int) -> list[tuple[list, list]]:
    """transformers' own greedy decoding (KV cache on, EOS ignored), one prompt at a time:
    per prompt, (tokens, the top-5 token ids at each position)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model(torch.tensor([prompt]), use_cache=True)
            tokens, tops = [], []
            for _ in range(num_tokens):
                logits = out.logits[0, -1]
                tokens.append(int(logits.argmax()))
                tops.append(set(logits.topk(TOP).indices.tolist()))
                out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values,
                            use_cache=True)
            results.append((tokens, tops))
    return results


def engine_greedy(outputs) -> list[tuple[list, list]]:
    """The engine's outputs (asked with ``logprobs=5``) in ``hf_greedy``'s shape."""
    return [(o.outputs[0].token_ids, [set(position) for position in o.outputs[0].logprobs])
            for o in outputs]


def check_logprobs_close(ours: list[tuple[list, list]], theirs: list[tuple[list, list]]) -> int:
    """vLLM's rule for greedy output against a reference: the sequences match, or at their
    first difference each side's token is among the other's top 5 (a near-tie decided by
    rounding), after which they may diverge. Returns how many sequences match exactly."""
    num_equal = 0
    for i, ((our_tokens, our_top), (their_tokens, their_top)) in enumerate(zip(ours, theirs,
                                                                             strict=True)):
        assert len(our_tokens) == len(their_tokens), (i, len(our_tokens), len(their_tokens))
        diverged = next((p for p, (a, b) in enumerate(zip(our_tokens, their_tokens)) if a != b),
                        None)
        if diverged is None:
            num_equal += 1
            continue
        a, b = our_tokens[diverged], their_tokens[diverged]
        assert a in their_top[diverged] and b in our_top[diverged], \
            f"sequence {i} diverges at position {diverged}: ours {a} (top-5 {our_top[diverged]}), " \
            f"reference {b} (top-5 {their_top[diverged]})"
    return num_equal


def assert_idle_and_nothing_leaked(llm) -> dict:
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert stats["num_requests_holding_blocks"] == 0
    return stats
