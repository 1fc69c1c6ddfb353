"""A causal LM read as a classifier of some of its tokens (vLLM's ``classifier_from_token``,
given by ``--hf-overrides``): Qwen3-Reranker and mxbai-rerank-v2 judge a query and a document
by the logits of "no" and "yes" at the prompt's last token.

    --hf-overrides '{"architectures": ["Qwen3ForSequenceClassification"],
                     "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}'

The LM head's rows of those tokens become the score head, so a step computes two logits, not
the whole vocabulary's: with the two-way softmax (``is_original_qwen3_reranker``, or vLLM's
newer ``"method": "from_2_way_softmax"``) one label, the row of the second token less the
first's, whose sigmoid is softmax(no, yes)'s "yes"; otherwise one label per token, each its
own row (the classifier's softmax is then the softmax over those tokens' logits).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from actorlm.kernels import QuantizedWeight

_TWO_WAY = "from_2_way_softmax"


def check_score_tokens(config) -> None:
    """Refuse what ``classifier_from_token`` cannot mean, and give the config its labels (one
    for the two-way softmax, else one per token)."""
    tokens = getattr(config, "classifier_from_token", None)
    if tokens is None:
        return
    architecture = (getattr(config, "architectures", None) or [""])[0]
    if not (isinstance(tokens, list) and tokens and all(isinstance(t, str) for t in tokens)):
        raise ValueError(f"classifier_from_token must be a list of token strings, got "
                         f"{tokens!r}")
    if not architecture.endswith("ForSequenceClassification"):
        raise ValueError(f"classifier_from_token needs the architecture overridden to a "
                         f"...ForSequenceClassification (vLLM's way), not {architecture!r}")
    method = getattr(config, "method", None)
    if method not in (None, _TWO_WAY):
        raise ValueError(f"method {method!r} is not implemented (only {_TWO_WAY!r})")
    two_way = is_two_way(config)
    if two_way and len(tokens) != 2:
        raise ValueError(f"the two-way softmax takes two tokens (no, yes), got {tokens}")
    config.num_labels = 1 if two_way else len(tokens)


def is_two_way(config) -> bool:
    return bool(getattr(config, "is_original_qwen3_reranker", False)) or \
        getattr(config, "method", None) == _TWO_WAY


def token_ids(config, tokenizer) -> list[int]:
    """Each of ``classifier_from_token``'s tokens as the tokenizer numbers it, one token each."""
    ids = [tokenizer.convert_tokens_to_ids(t) for t in config.classifier_from_token]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ValueError(f"classifier_from_token {config.classifier_from_token}: not all are "
                         f"tokens of the model's vocabulary (ids {ids})")
    return ids


def with_score_rows(weights: Iterable[tuple[str, Any]], config, ids: list[int],
                    tied: bool) -> Iterable[tuple[str, Any]]:
    """The checkpoint's tensors, and ``score.weight`` made of the LM head's rows ``ids`` (the
    embedding's, where the head is tied to it), in fp32, then the difference for the two-way
    softmax."""
    source = "model.embed_tokens.weight" if tied else "lm_head.weight"
    for name, tensor in weights:
        if name == source:
            if isinstance(tensor, QuantizedWeight):
                raise ValueError(f"classifier_from_token over an LM head in blocks ({name}) "
                                 f"is not implemented")
            rows = torch.cat([tensor[i:i + 1] for i in ids]).float()  # (a slice reads rows)
            yield "score.weight", (rows[1:] - rows[:1]) if is_two_way(config) else rows
        yield name, tensor
