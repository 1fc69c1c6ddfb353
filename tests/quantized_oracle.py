"""How a model in quantized blocks is judged against transformers on its dequantized weights:
they differ by the kernels' int8 quantization of the activations (per block, once per
matmul), so by the mean KL divergence of the next-token distribution over every position of a
prompt and its greedy continuation, and by vLLM's ``check_logprobs_close`` on the greedy
tokens."""

from __future__ import annotations

import torch
from greedy import TOP, check_logprobs_close
from paged_contexts import PagedContexts

MAX_MEAN_KL = 0.01  # nats, the bar the shipped file is held to
NUM_DECODED = 24


def mean_kl(reference: torch.Tensor, ours: torch.Tensor) -> float:
    """Mean over positions of KL(reference || ours) of the next-token distributions."""
    p = reference.double().log_softmax(-1)
    return float((p.exp() * (p - ours.double().log_softmax(-1))).sum(-1).mean())


def logits_and_greedy(model, prompt: list[int], num_tokens: int):
    """Our logits at every position of the prompt and of its greedy continuation, the tokens and
    each step's top 5."""
    cache = PagedContexts(model)
    logits = [cache.step(model, [(0, prompt)])]
    tokens, tops = [], []
    for i in range(num_tokens):
        last = logits[-1][-1]
        tokens.append(int(last.argmax()))
        tops.append(set(last.topk(TOP).indices.tolist()))
        if i + 1 < num_tokens:  # the last token's own logits are not needed
            logits.append(cache.step(model, [(0, tokens[-1:])]))
    return torch.cat(logits), tokens, tops


def their_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def check_greedy_and_kl(ours, theirs) -> float:
    """Our logits over a prompt and its greedy continuation within ``MAX_MEAN_KL`` of
    transformers' ``theirs``, and the two greedy continuations close by vLLM's rule; returns
    the mean KL."""
    prompt = list(range(3, 23))
    logits, tokens, tops = logits_and_greedy(ours, prompt, NUM_DECODED)
    expected = their_logits(theirs, prompt + tokens[:-1])
    kl = mean_kl(expected, logits)
    assert kl <= MAX_MEAN_KL
    their_tokens, their_tops = [], []
    for _ in range(NUM_DECODED):  # transformers' own greedy continuation
        last = their_logits(theirs, prompt + their_tokens)[-1]
        their_tokens.append(int(last.argmax()))
        their_tops.append(set(last.topk(TOP).indices.tolist()))
    check_logprobs_close([(tokens, tops)], [(their_tokens, their_tops)])
    return kl
