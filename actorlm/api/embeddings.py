"""``/v1/embeddings``: OpenAI's Embeddings API (with vLLM's extra fields) on a pooling model;
and vLLM's ``/pooling``, the same for either task (an embedding's vector, a classifier's
probabilities, as ``data``).

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

import msgspec
import numpy as np
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response

from actorlm.api import protocol as p
from actorlm.api.pooling_requests import PoolingUsage, PromptFields, pooled
from actorlm.api.responses import json_response
from actorlm.pooling import PoolingParams

NOT_EMBEDDING = "The model does not support Embeddings API"  # vLLM's words
NOT_POOLING = "The model does not support Pooling API"


class EmbeddingRequest(PromptFields, kw_only=True):
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = None  # the first this many (Matryoshka models only)
    user: str | None = None  # accepted and ignored, as OpenAI does
    # vLLM's extras
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1)] | None = None
    normalize: bool | None = None  # None: the model's choice
    priority: Annotated[int, Meta(ge=-2**63, le=2**63 - 1)] = 0

    def pooling_params(self, task: str) -> PoolingParams:
        return PoolingParams(task=task, dimensions=self.dimensions, normalize=self.normalize)

    def encoded(self, vector: list[float]) -> list[float] | str:
        return _base64(vector) if self.encoding_format == "base64" else vector


class PoolingRequest(EmbeddingRequest, kw_only=True):
    """vLLM's ``/pooling``: an embedding request that may name its task (null: the model's)
    and, for a classifier, whether to apply its activation."""

    task: str | None = None
    use_activation: bool | None = None

    def pooling_params(self, task: str) -> PoolingParams:
        return msgspec.structs.replace(super().pooling_params(task),
                                       use_activation=self.use_activation)


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


class PoolingData(Struct):
    index: int
    object: str
    data: list[float] | str  # str: base64


class PoolingResponse(Struct):
    id: str
    object: str
    created: int
    model: str
    data: list[PoolingData]
    usage: PoolingUsage


async def create_embedding(state, request: Request) -> Response:
    engine = state.ready_engine()
    if not engine.config.is_pooling or engine.config.pooler_config.task != "embed":
        raise p.ApiError(400, NOT_EMBEDDING)
    req = state.decoder.decode(await request.body(), EmbeddingRequest)
    api_id, finals, usage = await pooled(state, request, req, req.pooling_params("embed"),
                                         "embd")
    data = [EmbeddingData("embedding", i, req.encoded(f.outputs.embedding))
            for i, f in enumerate(finals)]
    return json_response(EmbeddingResponse(api_id, "list", int(time.time()), state.model_name,
                                           data, usage))


async def create_pooling(state, request: Request) -> Response:
    engine = state.ready_engine()
    if not engine.config.is_pooling:
        raise p.ApiError(400, NOT_POOLING)
    req = state.decoder.decode(await request.body(), PoolingRequest)
    task = req.task or engine.config.pooler_config.task
    api_id, finals, usage = await pooled(state, request, req, req.pooling_params(task), "pool")
    data = [PoolingData(i, "pooling", req.encoded(f.outputs.values))
            for i, f in enumerate(finals)]
    return json_response(PoolingResponse(api_id, "list", int(time.time()), state.model_name,
                                         data, usage))


def _base64(embedding: list[float]) -> str:
    """What the ``openai`` client decodes: the little-endian float32 bytes, base64."""
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
