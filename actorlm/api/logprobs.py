"""Logprobs in OpenAI's shapes (chat, legacy completions) and vLLM's prompt-logprobs shape,
from the engine's per-position ``{token_id: Logprob}`` dicts. Each token is written as its text
(``decode``), or, with ``decode`` None, as vLLM's ``token_id:<id>``."""

from __future__ import annotations

from actorlm.api.protocol import (ChatLogprobs, ChatLogprobToken, ChatTopLogprob,
                                  CompletionLogProbs, PromptLogprob, PromptLogprobs)

_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps the same way


def _token_text(token_id: int, lp, decode) -> str:
    if decode is None:  # vLLM's return_tokens_as_token_ids
        return f"token_id:{token_id}"
    text = getattr(lp, "decoded_token", None)
    return text if text is not None else decode([token_id])


def _value(lp) -> float:
    return max(float(lp.logprob), _MIN_LOGPROB)


def _ranked(position: dict) -> list:
    """(token_id, Logprob) candidates best first (the chosen token may come first otherwise)."""
    return sorted(position.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None
                                                    else 1 << 30))


def chat_logprobs(token_ids: list[int], positions: list[dict | None], num_top: int,
                  decode) -> ChatLogprobs:
    """OpenAI chat shape: each chosen token with its logprob and the ``num_top`` best."""
    content = []
    for token_id, position in zip(token_ids, positions):
        position = position or {}
        chosen = position.get(token_id)
        text = _token_text(token_id, chosen, decode)
        top = [ChatTopLogprob(t := _token_text(tid, lp, decode), _value(lp), list(t.encode()))
               for tid, lp in _ranked(position)[:num_top]] if num_top else []
        content.append(ChatLogprobToken(text, _value(chosen) if chosen else _MIN_LOGPROB,
                                        list(text.encode()), top))
    return ChatLogprobs(content)


def completion_logprobs(token_ids: list[int], positions: list[dict | None], num_top: int,
                        decode, text_offset: int = 0) -> CompletionLogProbs:
    """Legacy completions shape: the chosen tokens, their logprobs and up to ``num_top``
    alternatives plus the chosen one at each position (as OpenAI documents); a position
    without logprobs (an echoed prompt's first: nothing comes before it) has null for both."""
    out = CompletionLogProbs([], [], [], [])
    for token_id, position in zip(token_ids, positions):
        chosen = position.get(token_id) if position else None
        text = _token_text(token_id, chosen, decode)
        out.tokens.append(text)
        out.token_logprobs.append(_value(chosen) if chosen else None)
        out.text_offset.append(text_offset)
        text_offset += len(text)
        if position is None:
            out.top_logprobs.append(None)
            continue
        top = {}  # keyed by text: tokens that decode alike keep the best value
        for tid, lp in _ranked(position)[:num_top]:
            top.setdefault(_token_text(tid, lp, decode), _value(lp))
        if chosen is not None:
            top.setdefault(text, _value(chosen))
        out.top_logprobs.append(top if num_top or chosen else None)
    return out


def prompt_logprobs(positions: list[dict | None] | None) -> PromptLogprobs | None:
    if positions is None:
        return None
    return [None if position is None else {
        token_id: PromptLogprob(_value(lp), lp.rank, lp.decoded_token)
        for token_id, lp in position.items()} for position in positions]
