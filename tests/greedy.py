"""vLLM's rule for comparing greedy outputs with a reference's."""

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
