"""``/v1/embeddings``: OpenAI's Embeddings API (with vLLM's extra fields) on a pooling model.

A request's path: refuse it unless the model embeds (vLLM's words), decode it, refuse a LoRA
adapter (not implemented on pooling models), read ``input`` (text, texts, token ids or lists of
them) or ``messages`` (vLLM's chat form: one prompt, through the chat template), tokenize it
off the event loop (text that cannot fit is refused first), truncate if asked, then run one
engine request per input at once (``AsyncLLM.embed``) while watching the connection
(``pooling_requests``: a client that hangs up aborts them all, and so does one input the engine
refuses). The vectors come back in input order, as JSON numbers or (``encoding_format:
"base64"``, what the official ``openai`` client asks for) as the base64 of their little-endian
float32 bytes.
"""

from __future__ import annotations

import base64
import time
from typing import Annotated, Literal

import numpy as np
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response

from actorlm.api import protocol as p
from actorlm.api.pooling_requests import (PoolingUsage, PromptFields, check_base_model,
                                          engine_request_ids, pool_all, request_prompts)
from actorlm.api.responses import json_response
from actorlm.pooling import PoolingParams

NOT_EMBEDDING = "The model does not support Embeddings API"  # vLLM's words


class EmbeddingRequest(PromptFields, kw_only=True):
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = None  # the first this many (Matryoshka models only)
    user: str | None = None  # accepted and ignored, as OpenAI does
    # vLLM's extras
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    normalize: bool | None = None  # None: the model's choice
    priority: Annotated[int, Meta(ge=-2**63, le=2**63 - 1)] = 0

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(dimensions=self.dimensions, normalize=self.normalize)


class EmbeddingData(Struct):
    object: str
    index: int
    embedding: list[float] | str  # str: base64


class EmbeddingResponse(Struct):
    id: str
    object: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


async def create_embedding(state, request: Request) -> Response:
    engine = state.ready_engine()
    if not engine.config.is_pooling or engine.config.pooler_config.task != "embed":
        raise p.ApiError(400, NOT_EMBEDDING)
    req = state.decoder.decode(await request.body(), EmbeddingRequest)
    check_base_model(state, req.model)
    pooling = req.pooling_params()
    prompts = await request_prompts(state, engine, req)
    api_id, engine_ids = engine_request_ids(request, "embd", len(prompts))
    finals = await pool_all(request, engine_ids, prompts,
                            lambda ids, rid: engine.embed(ids, pooling, rid, req.priority))
    num_tokens = sum(len(f.prompt_token_ids) for f in finals)
    as_base64 = req.encoding_format == "base64"
    data = [EmbeddingData("embedding", i, _base64(f.outputs.embedding) if as_base64
                          else f.outputs.embedding) for i, f in enumerate(finals)]
    return json_response(EmbeddingResponse(api_id, "list", int(time.time()), state.model_name,
                                           data, PoolingUsage(num_tokens, num_tokens)))


def _base64(embedding: list[float]) -> str:
    """What the ``openai`` client decodes: the little-endian float32 bytes, base64."""
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
