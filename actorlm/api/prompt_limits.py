"""What a prompt may be before it reaches the engine: token ids inside the vocabulary, text
short enough to fit the context (checked before tokenizing), vLLM's prompt + max_tokens rule
and ``truncate_prompt_tokens``. Each refusal is a 400 naming the field."""

from __future__ import annotations

from actorlm.api import protocol as p
from actorlm.async_llm import AsyncLLM
from actorlm.prompt_rules import outside_vocabulary


def check_token_ids(engine: AsyncLLM, token_ids: list[int], field: str) -> None:
    if refusal := outside_vocabulary(field, token_ids, engine.vocab_size):
        raise p.ApiError(400, refusal, field)


def max_tokens_for(num_prompt_tokens: int, requested: int | None, max_model_len: int,
                   field: str = "max_tokens", default: int | None = None) -> int:
    """vLLM's check of prompt + completion against the context; None means the model's
    default (``max_new_tokens`` of its generation config) within the rest of the context, or
    without one, the rest of it."""
    if requested is not None and requested < 1:
        raise p.ApiError(400, f"{field}: must be at least 1, got {requested}", field)
    if requested is None:
        if num_prompt_tokens >= max_model_len:
            raise p.ApiError(400, f"This model's maximum context length is {max_model_len} tokens. "
                                  f"However, you requested {num_prompt_tokens} tokens in the "
                                  f"messages, Please reduce the length of the messages.")
        rest = max_model_len - num_prompt_tokens
        return rest if default is None else min(default, rest)
    if num_prompt_tokens + requested > max_model_len:
        raise p.ApiError(400, f"This model's maximum context length is {max_model_len} tokens. "
                              f"However, you requested {num_prompt_tokens + requested} tokens "
                              f"({num_prompt_tokens} in the messages, {requested} in the "
                              f"completion). Please reduce the length of the messages or "
                              f"completion.", field)
    return requested


def truncated(ids: list[int], keep: int | None, max_model_len: int,
              side: str | None = None) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: the context's
    worth), or with ``side`` "right" (vLLM's ``truncation_side``) its first; None keeps it
    whole."""
    if keep is None:
        return ids
    if keep == 0 or keep > max_model_len:
        raise p.ApiError(400, f"truncate_prompt_tokens: must be -1 or between 1 and the "
                              f"context length {max_model_len}, got {keep}",
                         "truncate_prompt_tokens")
    keep = max_model_len if keep == -1 else keep
    return ids[:keep] if side == "right" else ids[-keep:]


def check_text_length(state, num_chars: int, req) -> None:
    """Refuse, before tokenizing it (seconds of the one submit thread), text that cannot fit:
    no token spells more than ``state.max_token_chars`` characters."""
    limit = state.engine.max_model_len * state.max_token_chars
    if req.truncate_prompt_tokens is None and num_chars > limit:
        raise p.ApiError(400, f"This model's maximum context length is "
                              f"{state.engine.max_model_len} tokens, and the prompt's "
                              f"{num_chars} characters cannot fit in it. Please reduce the "
                              f"length of the messages.")
