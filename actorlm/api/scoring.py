"""vLLM's pooling routes beyond embeddings: ``/classify``, ``/score`` and ``/rerank``.

``/classify`` runs a ``...ForSequenceClassification`` checkpoint over each input (or over a
conversation through the chat template: ``messages``) and names the likeliest label
(``id2label``). ``/score`` and ``/rerank`` rate text pairs as ``LLM.score``
does: a cross-encoder (a classifier of one label) reads each pair together, joined by its
tokenizer, and gives its probability; an embedding model embeds each distinct text once and
gives the cosine similarity of the pair's vectors. A classifier of several labels cannot
score: its answer is a distribution, not one number. ``/rerank`` is ``/score`` of the query
against each document, best first (Jina's and Cohere's shape). Every route refuses a model
that cannot do its task before reading the body, as vLLM does.
"""

from __future__ import annotations

import time
from typing import Annotated

from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import Response

from actorlm.api import protocol as p
from actorlm.api.pooling_requests import (PoolingUsage, PromptFields, check_base_model,
                                          engine_request_ids, pool_all, pooled, tokenized)
from actorlm.api.responses import json_response
from actorlm.async_llm import AsyncLLM
from actorlm.llm import cosine, score_pairs
from actorlm.pooling import PoolingParams

TruncateTokens = Annotated[int, Meta(ge=-1)] | None
# vLLM's paths for each route (its aliases included)
SCORE_PATHS = ("/score", "/v1/score")
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank")


class ClassificationRequest(PromptFields, kw_only=True):
    model: str | None = None
    user: str | None = None  # accepted and ignored
    truncate_prompt_tokens: TruncateTokens = None
    use_activation: bool | None = None  # false: the logits rather than the probabilities
    priority: Annotated[int, Meta(ge=-2**63, le=2**63 - 1)] = 0


class ClassificationData(Struct):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(Struct):
    id: str
    object: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class ScoreRequest(Struct, kw_only=True):
    text_1: str | list[str]  # one text against each of text_2, or as many as text_2
    text_2: str | list[str]
    model: str | None = None
    truncate_prompt_tokens: TruncateTokens = None


class ScoreData(Struct):
    index: int
    object: str
    score: float


class ScoreResponse(Struct):
    id: str
    object: str
    created: int
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankRequest(Struct, kw_only=True):
    query: str
    documents: list[str]
    model: str | None = None
    top_n: Annotated[int, Meta(ge=0)] | None = None  # 0 or None: every document
    truncate_prompt_tokens: TruncateTokens = None


class RerankDocument(Struct):
    text: str


class RerankResult(Struct):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(Struct):
    total_tokens: int


class RerankResponse(Struct):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


async def create_classification(state, request: Request) -> Response:
    engine = state.ready_engine()
    if _task(engine) != "classify":
        raise p.ApiError(400, "The model does not support Classification API")
    req = state.decoder.decode(await request.body(), ClassificationRequest)
    api_id, finals, usage = await pooled(
        state, request, req, PoolingParams(task="classify", use_activation=req.use_activation),
        "classify")
    labels = engine.engine.hf_config.id2label
    data = []
    for i, final in enumerate(finals):
        probs = final.outputs.probs
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append(ClassificationData(i, labels.get(best, f"LABEL_{best}"), probs, len(probs)))
    return json_response(ClassificationResponse(api_id, "list", int(time.time()),
                                                state.model_name, data, usage))


async def create_score(state, request: Request) -> Response:
    engine = _scoring_engine(state, "Score API")
    req = state.decoder.decode(await request.body(), ScoreRequest)
    check_base_model(state, req.model)
    try:
        pairs = score_pairs(req.text_1, req.text_2)
    except ValueError:
        firsts = 1 if isinstance(req.text_1, str) else len(req.text_1)
        seconds = 1 if isinstance(req.text_2, str) else len(req.text_2)
        field = "text_2" if seconds == 0 else "text_1"
        raise p.ApiError(400, f"{field}: text_1 must be one text or as many as text_2 (got "
                              f"{firsts} and {seconds}), and text_2 not empty", field) from None
    api_id, scores, num_tokens = await _scores(state, request, engine, pairs, req, "score",
                                              "text_2")
    data = [ScoreData(i, "score", score) for i, score in enumerate(scores)]
    return json_response(ScoreResponse(api_id, "list", int(time.time()), state.model_name, data,
                                       PoolingUsage(num_tokens, num_tokens)))


async def create_rerank(state, request: Request) -> Response:
    engine = _scoring_engine(state, "Rerank API")
    req = state.decoder.decode(await request.body(), RerankRequest)
    check_base_model(state, req.model)
    if not req.documents:
        raise p.ApiError(400, "documents: at least one document is required", "documents")
    pairs = [(req.query, doc) for doc in req.documents]
    api_id, scores, num_tokens = await _scores(state, request, engine, pairs, req, "rerank",
                                              "documents")
    best_first = sorted(range(len(scores)), key=lambda i: -scores[i])
    results = [RerankResult(i, RerankDocument(req.documents[i]), scores[i])
               for i in best_first[:req.top_n or None]]
    return json_response(RerankResponse(api_id, state.model_name, RerankUsage(num_tokens),
                                        results))


async def _scores(state, request: Request, engine: AsyncLLM, pairs: list[tuple[str, str]], req,
                  prefix: str, field: str) -> tuple[str, list[float], int]:
    """(the answer's id, each pair's score, the prompt tokens read); ``field``: what a
    refusal of a text names."""
    if _task(engine) == "classify":  # a cross-encoder (``_scoring_engine``)
        prompt_ids = await tokenized(state, engine, pairs, req, field)
        api_id, engine_ids = engine_request_ids(request, prefix, len(prompt_ids))
        finals = await pool_all(request, engine_ids, prompt_ids,
                                lambda ids, rid: engine.classify(ids, None, rid))
        return api_id, [f.outputs.probs[0] for f in finals], sum(map(len, prompt_ids))
    texts = list(dict.fromkeys(text for pair in pairs for text in pair))
    prompt_ids = await tokenized(state, engine, texts, req, field)
    api_id, engine_ids = engine_request_ids(request, prefix, len(prompt_ids))
    finals = await pool_all(request, engine_ids, prompt_ids,
                            lambda ids, rid: engine.embed(ids, None, rid))
    vectors = dict(zip(texts, finals))
    return (api_id, [cosine(vectors[a], vectors[b]) for a, b in pairs],
            sum(map(len, prompt_ids)))


def _scoring_engine(state, api: str) -> AsyncLLM:
    """The engine, if it can score: an embedding model or a cross-encoder."""
    engine = state.ready_engine()
    if _task(engine) is None:
        raise p.ApiError(400, f"The model does not support {api}")
    if _task(engine) == "classify" and (labels := engine.engine.hf_config.num_labels) != 1:
        raise p.ApiError(400, f"The model does not support {api}: it classifies into {labels} "
                              f"labels, and scores need a cross-encoder (one label) or an "
                              f"embedding model; /classify gives its probabilities")
    return engine


def _task(engine: AsyncLLM) -> str | None:
    """The pooling model's task ("embed", "classify"); None for a model that generates."""
    return engine.config.pooler_config.task if engine.config.is_pooling else None
