"""``/v1/embeddings``: OpenAI's Embeddings API (with vLLM's extra fields) on a pooling model.

A request's path: refuse it unless the model pools (vLLM's words), decode it, refuse a LoRA
adapter (not implemented on pooling models), read ``input`` (text, texts, token ids or lists of
them), refuse text that cannot fit before tokenizing it, tokenize off the event loop, truncate
if asked, then run one engine request per input at once (``AsyncLLM.embed``) while watching
the connection: a client that hangs up aborts them all, and so does one input the engine
refuses. The vectors come back in input order, as JSON numbers or (``encoding_format:
"base64"``, what the official ``openai`` client asks for) as the base64 of their
little-endian float32 bytes.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
import uuid
from typing import Annotated, Any, Literal

import numpy as np
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response

from actorlm.api import protocol as p
from actorlm.api.prompt_limits import check_text_length, check_token_ids, truncated
from actorlm.api.responses import json_response
from actorlm.api.serving import unless_disconnected
from actorlm.async_llm import AsyncLLM
from actorlm.outputs import EmbeddingRequestOutput
from actorlm.pooling import PoolingParams
from actorlm.prompt_rules import empty_prompt

log = logging.getLogger(__name__)

NOT_POOLING = "The model does not support Embeddings API"  # vLLM's words


class EmbeddingRequest(Struct, kw_only=True):
    # text, a list of texts, token ids, or a list of token-id lists (checked in inputs())
    input: str | list[Any]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = None  # the first this many (Matryoshka models only)
    user: str | None = None  # accepted and ignored, as OpenAI does
    # vLLM's extras
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    add_special_tokens: bool | None = True
    normalize: bool | None = None  # None: the model's choice
    priority: Annotated[int, Meta(ge=-2**63, le=2**63 - 1)] = 0

    def inputs(self) -> list[str | list[int]]:
        """The inputs of this request: each text or token ids."""
        x = self.input
        if isinstance(x, str):
            return [x]
        if not x:
            raise p.ApiError(400, empty_prompt("input"), "input")
        if all(isinstance(item, str) for item in x):
            return list(x)
        if all(_is_int(item) for item in x):
            return [list(x)]
        if all(isinstance(item, list) and all(_is_int(t) for t in item) for item in x):
            return [list(item) for item in x]
        raise p.ApiError(400, "input: expected a string, a list of strings, a list of token ids "
                              "or a list of token-id lists", "input")

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(dimensions=self.dimensions, normalize=self.normalize)


class EmbeddingData(Struct):
    object: str
    index: int
    embedding: list[float] | str  # str: base64


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Struct):
    id: str
    object: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


async def create_embedding(state, request: Request) -> Response:
    engine = state.ready_engine()
    if not engine.config.is_pooling:
        raise p.ApiError(400, NOT_POOLING)
    req = state.decoder.decode(await request.body(), EmbeddingRequest)
    if state.resolve_model(req.model) is not None:
        raise p.ApiError(400, f"model: {req.model!r} is a LoRA adapter; adapters on a pooling "
                              f"model are not implemented", "model")
    pooling = req.pooling_params()
    inputs = req.inputs()
    for x in inputs:
        if isinstance(x, str):
            check_text_length(state, len(x), req)
        else:
            check_token_ids(engine, x, "input")
    add_special = p.or_default(req.add_special_tokens, True)
    prompt_ids = await engine.run_blocking(
        lambda: [engine.encode(x, add_special) if isinstance(x, str) else x for x in inputs])
    if any(not ids for ids in prompt_ids):
        raise p.ApiError(400, empty_prompt("input"), "input")
    prompt_ids = [truncated(ids, req.truncate_prompt_tokens, engine.max_model_len)
                  for ids in prompt_ids]
    # the API id carries the X-Request-Id; the engine's must be unique whatever clients send
    api_id = engine_id = f"embd-{request.state.request_id}"
    if request.state.request_id_from_client:
        engine_id += f"-{uuid.uuid4().hex[:8]}"
    request_ids = [engine_id] if len(prompt_ids) == 1 else \
        [f"{engine_id}-{i}" for i in range(len(prompt_ids))]
    work = asyncio.ensure_future(_embed_all(engine, prompt_ids, pooling, request_ids,
                                            req.priority))
    if not await unless_disconnected(request, work):
        log.info("%s: client disconnected; aborted", engine_id)
        return Response(status_code=499)
    finals = work.result()
    num_tokens = sum(len(f.prompt_token_ids) for f in finals)
    as_base64 = req.encoding_format == "base64"
    data = [EmbeddingData("embedding", i, _base64(f.outputs.embedding) if as_base64
                          else f.outputs.embedding) for i, f in enumerate(finals)]
    return json_response(EmbeddingResponse(api_id, "list", int(time.time()), state.model_name,
                                           data, EmbeddingUsage(num_tokens, num_tokens)))


async def _embed_all(engine: AsyncLLM, prompt_ids: list[list[int]], pooling: PoolingParams,
                     request_ids: list[str], priority: int) -> list[EmbeddingRequestOutput]:
    """Every input's final output, in input order, all running at once."""
    tasks = [asyncio.ensure_future(engine.embed(ids, pooling, rid, priority))
             for ids, rid in zip(prompt_ids, request_ids)]
    try:
        finals = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # after a refusal or a failure: the others stop (``embed`` aborts)
            task.cancel()
    for final in finals:
        if final.error:
            raise p.ApiError(500, f"the engine failed this request: {final.error}")
    return finals


def _base64(embedding: list[float]) -> str:
    """What the ``openai`` client decodes: the little-endian float32 bytes, base64."""
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
