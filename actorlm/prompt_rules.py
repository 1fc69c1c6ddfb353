"""What a prompt's token ids may be, in one place: the frontend refuses what breaks a rule with
a ``ValueError`` (offline and served alike), and the API, which checks before it tokenizes or
queues anything, with a 400 naming the field; both say it in these words."""

from __future__ import annotations

from typing import Iterable


def empty_prompt(field: str) -> str:
    return f"{field}: the prompt is empty"


def outside_vocabulary(field: str, token_ids: Iterable, vocab_size: int) -> str | None:
    """Why ``token_ids`` cannot be read, naming the first that is not a token id in
    [0, ``vocab_size``); None when every one is."""
    for token_id in token_ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or \
                not 0 <= token_id < vocab_size:
            return f"{field}: token id {token_id!r} is outside the vocabulary [0, {vocab_size})"
    return None


def open_and_closed(add_generation_prompt: bool, continue_final_message: bool) -> str | None:
    """Why a conversation cannot end both ways: with the assistant's turn opened and with its
    last message left open to continue (vLLM refuses the pair too); None when it does not."""
    if add_generation_prompt and continue_final_message:
        return ("continue_final_message: cannot be used together with add_generation_prompt "
                "(turn that off)")
    return None
