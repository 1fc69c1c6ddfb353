"""Oracles and checks shared by the engine tests."""

import torch
from transformers import AutoModelForCausalLM


def hf_greedy(model_dir, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """transformers' own greedy decoding (KV cache on, EOS ignored), one prompt at a time."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model(torch.tensor([prompt]), use_cache=True)
            tokens = []
            for _ in range(num_tokens):
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
                out = model(torch.tensor([[token]]), past_key_values=out.past_key_values,
                            use_cache=True)
            results.append(tokens)
    return results


def assert_idle_and_nothing_leaked(llm) -> dict:
    stats = llm.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert stats["num_requests_holding_blocks"] == 0
    return stats
