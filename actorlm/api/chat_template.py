"""The chat template over a client's conversation, with the client's input kept as data.

``chat_template_kwargs`` become variables of the template, so they may not name what the
server sets: the arguments of ``apply_chat_template`` (``add_generation_prompt``,
``conversation``, ``chat_template``, ``tokenize``…, which also collide with ours as a
TypeError) or the variables it fills in (``messages``, the special tokens). A template is a
program the server runs, so a request may bring one only when the operator allows it
(``--trust-request-chat-template``, as in vLLM); the operator may give the server one in
place of the model's (``--chat-template``). Whatever the template raises on a client's input
is that client's 400.

A request with vLLM's chat fields says how its conversation ends (``template_call``): with the
generation prompt (the assistant's turn opened), or, ``continue_final_message``, with its last
message left open for the model to carry on (the two exclude each other, as in vLLM); its
``reasoning_effort`` is the template's variable of that name, as vLLM passes it.
"""

from __future__ import annotations

import inspect

from transformers import PreTrainedTokenizerBase

from actorlm.api.errors import ApiError
from actorlm.api.options import ServerOptions
from actorlm.async_llm import AsyncLLM
from actorlm.prompt_rules import open_and_closed

RESERVED_KWARGS = frozenset(
    set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters)
    - {"self", "kwargs"}
    | {"messages", "conversation", "chat_template", "add_generation_prompt", "tokenize",
       "content_format",
       "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
       "mask_token", "additional_special_tokens", "raise_exception", "strftime_now"})


def template_arguments(kwargs: dict | None, chat_template: str | None,
                       options: ServerOptions) -> dict:
    """The keyword arguments a request may pass to the template; a 400 for the rest. Without
    a template of its own, a request gets the server's (``--chat-template``) where it has one,
    else the model's."""
    for name in kwargs or {}:
        if name in RESERVED_KWARGS:
            raise ApiError(400, f"chat_template_kwargs: {name!r} is set by the server",
                           "chat_template_kwargs")
    if chat_template is None:
        chat_template = options.chat_template
    elif not options.trust_request_chat_template:
        raise ApiError(400, "chat_template: this server runs only its own chat template "
                            "(see --trust-request-chat-template)", "chat_template")
    if chat_template is None:
        return dict(kwargs or {})
    return {**(kwargs or {}), "chat_template": chat_template}


def template_call(req, options: ServerOptions, generation_prompt: bool) -> tuple[bool, dict]:
    """``apply_chat_template``'s arguments for a request with vLLM's chat fields
    (``add_generation_prompt``, ``continue_final_message``, ``chat_template``,
    ``chat_template_kwargs``): whether to add the generation prompt (``generation_prompt``, the
    route's default, where the request leaves it null), and the rest. Special tokens beyond
    the template's own (``add_special_tokens: true``) are refused."""
    if getattr(req, "add_special_tokens", None):
        raise ApiError(400, "add_special_tokens: with messages, the chat template's special "
                            "tokens are the prompt's; more are not supported",
                       "add_special_tokens")
    kwargs = template_arguments(req.chat_template_kwargs, req.chat_template, options)
    add_generation_prompt = (generation_prompt if req.add_generation_prompt is None
                             else req.add_generation_prompt)
    if error := open_and_closed(add_generation_prompt, req.continue_final_message):
        raise ApiError(400, error, "continue_final_message")
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    if getattr(req, "reasoning_effort", None) is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
    kwargs["content_format"] = options.chat_template_content_format
    return add_generation_prompt, kwargs


async def apply_chat_template(engine: AsyncLLM, conversation: list[dict],
                              add_generation_prompt: bool, **kwargs) -> list[int]:
    try:
        return await engine.run_blocking(
            lambda: engine.apply_chat_template(conversation, add_generation_prompt, **kwargs))
    except Exception as exc:  # the template refused the client's input, or failed on it
        raise ApiError(400, f"messages: the chat template failed: {type(exc).__name__}: {exc}",
                       "messages") from None
