"""What the pooling routes (``embeddings``, ``scoring``) share: reading ``input`` (or, in
vLLM's chat form, ``messages``), turning prompts into checked token ids off the event loop,
and running one engine request per prompt at once while watching the connection.

The chat form renders the conversation through the model's chat template, as vLLM's does: no
generation prompt unless asked, and no special tokens beyond the template's own
(``chat_template.template_call``).

A client that hangs up aborts every request of its call, and so does one prompt the engine
refuses: ``pool_all`` cancels the rest, and a cancelled ``AsyncLLM.embed``/``classify`` aborts
its request.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Awaitable, Callable

from msgspec import Struct
from starlette.requests import ClientDisconnect, Request

from actorlm.api import protocol as p
from actorlm.api.chat_template import apply_chat_template, template_call
from actorlm.api.prompt_limits import check_text_length, check_token_ids, truncated
from actorlm.api.serving import unless_disconnected
from actorlm.async_llm import AsyncLLM
from actorlm.pooling import PoolingParams
from actorlm.prompt_rules import empty_prompt

log = logging.getLogger(__name__)

# what one prompt may be: text, token ids, or (a cross-encoder's) two texts read together
Prompt = str | list[int] | tuple[str, str]


class PoolingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class PromptFields(Struct, kw_only=True):
    """A pooling request's prompts: ``input`` (text, texts, token ids or lists of them), or
    ``messages`` with vLLM's chat fields; exactly one of the two."""

    input: str | list[Any] | None = None
    messages: list[p.ChatMessage] | None = None
    add_special_tokens: bool | None = None  # null: true for input, false for messages
    add_generation_prompt: bool | None = False
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # only with --trust-request-chat-template


async def request_prompts(state, engine: AsyncLLM, req: PromptFields) -> list[list[int]]:
    """The token ids of each of the request's prompts, checked (``tokenized``)."""
    if (req.input is None) == (req.messages is None):
        raise p.ApiError(400, "input: give either input or messages", "input")
    if req.input is not None:
        return await tokenized(state, engine, read_inputs(req.input), req,
                               add_special_tokens=p.or_default(req.add_special_tokens, True))
    if not req.messages:
        raise p.ApiError(400, "messages: the conversation is empty", "messages")
    conversation = p.conversation(req.messages)
    check_text_length(state, p.num_chars(req.messages, conversation), req)
    add_generation_prompt, kwargs = template_call(req, state.options, False)
    ids = await apply_chat_template(engine, conversation, add_generation_prompt, **kwargs)
    return [truncated(ids, req.truncate_prompt_tokens, engine.max_model_len)]


async def pooled(state, request: Request, req, params: PoolingParams,
                 prefix: str) -> tuple[str, list, PoolingUsage]:
    """Run a pooling request (``PromptFields`` with ``model`` and ``priority``) through the
    engine's ``params.task``: (the answer's id, each prompt's final output, the usage)."""
    engine = state.ready_engine()
    check_base_model(state, req.model)
    prompts = await request_prompts(state, engine, req)
    run = engine.classify if params.task == "classify" else engine.embed
    api_id, engine_ids = engine_request_ids(request, prefix, len(prompts))
    finals = await pool_all(request, engine_ids, prompts,
                            lambda ids, rid: run(ids, params, rid, req.priority))
    num_tokens = sum(len(f.prompt_token_ids) for f in finals)
    return api_id, finals, PoolingUsage(num_tokens, num_tokens)


def check_base_model(state, model: str | None) -> None:
    """A 404 for a model nobody serves; a 400 for a LoRA adapter (none on a pooling model)."""
    if state.resolve_model(model) is not None:
        raise p.ApiError(400, f"model: {model!r} is a LoRA adapter; adapters on a pooling "
                              f"model are not implemented", "model")


def read_inputs(x: str | list[Any], field: str = "input") -> list[str | list[int]]:
    """The prompts of an ``input``: a text, texts, token ids or token-id lists."""
    if isinstance(x, str):
        return [x]
    if not x:
        raise p.ApiError(400, empty_prompt(field), field)
    if all(isinstance(item, str) for item in x):
        return list(x)
    if all(_is_int(item) for item in x):
        return [list(x)]
    if all(isinstance(item, list) and all(_is_int(t) for t in item) for item in x):
        return [list(item) for item in x]
    raise p.ApiError(400, f"{field}: expected a string, a list of strings, a list of token ids "
                          f"or a list of token-id lists", field)


async def tokenized(state, engine: AsyncLLM, prompts: list[Prompt], req, field: str = "input",
                    add_special_tokens: bool = True) -> list[list[int]]:
    """Each prompt's token ids, checked and cut to ``req.truncate_prompt_tokens``; text that
    cannot fit is refused before the (blocking) tokenizer sees it."""
    for x in prompts:
        if isinstance(x, list):
            check_token_ids(engine, x, field)
        else:
            check_text_length(state, len(x) if isinstance(x, str) else sum(map(len, x)), req)

    def encode(x: Prompt) -> list[int]:
        if isinstance(x, str):
            return engine.encode(x, add_special_tokens)
        if isinstance(x, tuple):  # as the cross-encoder was trained: the tokenizer's pair
            return list(engine.tokenizer(*x)["input_ids"])
        return x

    prompt_ids = await engine.run_blocking(lambda: [encode(x) for x in prompts])
    if any(not ids for ids in prompt_ids):
        raise p.ApiError(400, empty_prompt(field), field)
    return [truncated(ids, req.truncate_prompt_tokens, engine.max_model_len)
            for ids in prompt_ids]


def engine_request_ids(request: Request, prefix: str, num_prompts: int) -> tuple[str, list[str]]:
    """The answer's id (it carries the X-Request-Id) and one engine id per prompt."""
    # the engine's ids must be unique whatever clients send
    api_id = engine_id = f"{prefix}-{request.state.request_id}"
    if request.state.request_id_from_client:
        engine_id += f"-{uuid.uuid4().hex[:8]}"
    if num_prompts == 1:
        return api_id, [engine_id]
    return api_id, [f"{engine_id}-{i}" for i in range(num_prompts)]


async def pool_all(request: Request, engine_ids: list[str], prompt_ids: list[list[int]],
                   pool: Callable[[list[int], str], Awaitable]) -> list:
    """Every prompt's final output, in prompt order: ``pool(ids, engine_id)`` for each, all at
    once. Raises ClientDisconnect (a 499, with every request aborted) if the client hangs up."""
    work = asyncio.ensure_future(_gather_all(engine_ids, prompt_ids, pool))
    if not await unless_disconnected(request, work):
        log.info("%s: client disconnected; aborted", engine_ids[0])
        raise ClientDisconnect()
    return work.result()


async def _gather_all(engine_ids: list[str], prompt_ids: list[list[int]],
                      pool: Callable[[list[int], str], Awaitable]) -> list:
    tasks = [asyncio.ensure_future(pool(ids, rid)) for ids, rid in zip(prompt_ids, engine_ids)]
    try:
        finals = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # after a refusal or a failure: the others stop (and abort)
            task.cancel()
    for final in finals:
        if final.error:
            raise p.ApiError(500, f"the engine failed this request: {final.error}")
    return finals


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
