"""vLLM's rule for comparing greedy outputs with a reference's, and the reference's greedy."""

TOP = 5  # vLLM's check_logprobs_close looks at the top 5


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


def hf_continuation(model, prompt: list[int], num_tokens: int) -> tuple[list, list]:
    """A transformers model's greedy continuation of ``prompt`` (its own KV cache, EOS
    ignored): (tokens, the top-5 token ids at each position)."""
    import torch

    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens, tops = [], []
        for _ in range(num_tokens):
            last = out.logits[0, -1]
            tokens.append(int(last.argmax()))
            tops.append(set(last.topk(TOP).indices.tolist()))
            out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return tokens, tops
