"""The chat template over a client's conversation, with the client's input kept as data.

``chat_template_kwargs`` become variables of the template, so they may not name what the
server sets: the arguments of ``apply_chat_template`` (``add_generation_prompt``,
``conversation``, ``chat_template``, ``tokenize``…, which also collide with ours as a
TypeError) or the variables it fills in (``messages``, the special tokens). A template is a
program the server runs, so a request may bring one only when the operator allows it
(``--trust-request-chat-template``, as in vLLM). Whatever the template raises on a client's
input is that client's 400.
"""

from __future__ import annotations

import inspect

from transformers import PreTrainedTokenizerBase

from actorlm.api.errors import ApiError
from actorlm.async_llm import AsyncLLM

RESERVED_KWARGS = frozenset(
    set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    - {"self", "kwargs"}
    | {"messages", "conversation", "chat_template", "add_generation_prompt", "tokenize",
       "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
       "mask_token", "additional_special_tokens", "raise_exception", "strftime_now"})


def template_arguments(kwargs: dict | None, chat_template: str | None,
                       trust_chat_template: bool) -> dict:
    """The keyword arguments a request may pass to the template; a 400 for the rest."""
    for name in kwargs or {}:
        if name in RESERVED_KWARGS:
            raise ApiError(400, f"chat_template_kwargs: {name!r} is set by the server",
                           "chat_template_kwargs")
    if chat_template is None:
        return dict(kwargs or {})
    if not trust_chat_template:
        raise ApiError(400, "chat_template: this server runs only its own chat template "
                            "(see --trust-request-chat-template)", "chat_template")
    return {**(kwargs or {}), "chat_template": chat_template}


async def apply_chat_template(engine: AsyncLLM, conversation: list[dict],
                              add_generation_prompt: bool, **kwargs) -> list[int]:
    try:
        return await engine.run_blocking(
            lambda: engine.apply_chat_template(conversation, add_generation_prompt, **kwargs))
    except Exception as exc:  # the template refused the client's input, or failed on it
        raise ApiError(400, f"messages: the chat template failed: {type(exc).__name__}: {exc}",
                       "messages") from None
