"""``/openapi.json``: the API's contract, generated from the very msgspec types that decode the
requests and encode the answers, so the document cannot drift from the server.

msgspec writes JSON Schema 2020-12, which is what OpenAPI 3.1 uses. Every operation declares
its errors as ``default``: OpenAI's error shape, whatever the status.
"""

from __future__ import annotations

import re

import msgspec

import actorlm
from actorlm.api import protocol as p
from actorlm.api.embeddings import (EmbeddingRequest, EmbeddingResponse, PoolingRequest,
                                    PoolingResponse)
from actorlm.api.errors import ErrorResponse
from actorlm.api.lora_routes import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from actorlm.api.protocol_responses import DeletedResponse, ResponseObject, ResponsesRequest
from actorlm.api.scoring import (RERANK_PATHS, SCORE_PATHS, ClassificationRequest,
                                 ClassificationResponse, RerankRequest, RerankResponse,
                                 ScoreRequest, ScoreResponse)
from actorlm.api.security import OPEN_PATHS

_REF = "#/components/schemas/{name}"
# one Server-Sent Event as OpenAPI models it (``schema`` per event before 3.2's ``itemSchema``):
# ``data`` is a chunk's JSON, or "[DONE]"
_SSE = {"text/event-stream": {"schema": {
    "type": "object", "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"},
                   "id": {"type": "string"}, "retry": {"type": "integer"}}}}}
_TEXT = {"schema": {"type": "string"}}

# (method, path, summary, request type, response type or {media type: content})
OPERATIONS = [
    ("post", "/v1/completions", "Completions (streamed as Server-Sent Events when stream is "
     "true)", p.CompletionRequest, p.CompletionResponse),
    ("post", "/v1/chat/completions", "Chat completions (streamed as Server-Sent Events when "
     "stream is true)", p.ChatCompletionRequest, p.ChatCompletionResponse),
    ("post", "/v1/responses", "OpenAI's Responses API (streamed as Server-Sent Events when "
     "stream is true)", ResponsesRequest, ResponseObject),
    ("get", "/v1/responses/{response_id}", "A stored response", None, ResponseObject),
    ("delete", "/v1/responses/{response_id}", "Forget a stored response", None,
     DeletedResponse),
    ("post", "/v1/responses/{response_id}/cancel", "Stop a background response still running",
     None, ResponseObject),
    ("get", "/v1/responses/{response_id}/input_items", "A stored response's input items, a "
     "page at a time (query: limit, order, after)", None,
     {"application/json": {"schema": {"type": "object"}}}),
    ("post", "/v1/embeddings", "Embeddings (a pooling model's)", EmbeddingRequest,
     EmbeddingResponse),
    ("post", "/classify", "Class probabilities and the likeliest label (a classifier's)",
     ClassificationRequest, ClassificationResponse),
    ("post", "/pooling", "A pooling model's output: an embedding's vector or a classifier's "
     "probabilities", PoolingRequest, PoolingResponse),
    *[("post", path, "Scores of text pairs (a cross-encoder's, or an embedding model's cosine "
       "similarity)", ScoreRequest, ScoreResponse) for path in SCORE_PATHS],
    *[("post", path, "Documents ranked by their score against a query (Jina's and Cohere's "
       "shape)", RerankRequest, RerankResponse) for path in RERANK_PATHS],
    ("get", "/v1/models", "The served model and its LoRA adapters", None, p.ModelList),
    ("post", "/tokenize", "Token ids of a prompt or a conversation", p.TokenizeRequest,
     p.TokenizeResponse),
    ("post", "/detokenize", "Text of token ids", p.DetokenizeRequest, p.DetokenizeResponse),
    ("post", "/reset_prefix_cache", "Forget every cached prompt prefix", None, {}),
    ("get", "/health", "200 while the engine serves, 503 otherwise", None, {}),
    ("get", "/ping", "SageMaker's health check: /health", None, {}),
    ("post", "/ping", "SageMaker's health check: /health", None, {}),
    ("post", "/invocations", "SageMaker's: a chat (messages), completions (prompt) or "
     "embeddings (input) request, answered as that API answers it", None, {}),
    ("get", "/load", "Requests the server is working on (vLLM's server_load): generation, "
     "pooling and scoring requests from their arrival to their answer's last byte", None,
     {"application/json": {"schema": {"type": "object", "required": ["server_load"],
                                      "properties": {"server_load": {"type": "integer"}}}}}),
    ("get", "/version", "The actorlm version", None,
     {"application/json": {"schema": {"type": "object", "required": ["version"],
                                      "properties": {"version": {"type": "string"}}}}}),
    ("get", "/metrics", "Prometheus metrics (vLLM's names)", None, {"text/plain": _TEXT}),
    ("get", "/trace", "The live trace visualizer", None, {"text/html": _TEXT}),
    ("get", "/trace.json", "The trace as JSON lines", None, {"application/x-ndjson": _TEXT}),
    ("get", "/openapi.json", "This document", None,
     {"application/json": {"schema": {"type": "object"}}}),
]
_STREAMING = {"/v1/completions", "/v1/chat/completions", "/v1/responses"}
# with VLLM_ALLOW_RUNTIME_LORA_UPDATING only
LORA_OPERATIONS = [
    ("post", "/v1/load_lora_adapter", "Serve a LoRA adapter's directory under a model name",
     LoadLoRAAdapterRequest, {"text/plain": _TEXT}),
    ("post", "/v1/unload_lora_adapter", "Stop serving a LoRA adapter", UnloadLoRAAdapterRequest,
     {"text/plain": _TEXT}),
]


def openapi_document(requires_api_key: bool, runtime_lora: bool = False,
                     root_path: str = "") -> dict:
    """``root_path``: the prefix a proxy serves the routes under (the document's server)."""
    operations = OPERATIONS + (LORA_OPERATIONS if runtime_lora else [])
    types = [t for op in operations for t in (op[3], op[4]) if isinstance(t, type)]
    refs, schemas = msgspec.json.schema_components([*types, ErrorResponse],
                                                   ref_template=_REF)
    ref_of = dict(zip([*types, ErrorResponse], refs))
    paths: dict[str, dict] = {}
    for method, path, summary, request, response in operations:
        if isinstance(response, type):
            content = {"application/json": {"schema": ref_of[response]}}
        else:
            content = response
        if path in _STREAMING:
            content = {**content, **_SSE}
        operation = {
            "summary": summary,
            "responses": {
                "200": {"description": "OK", **({"content": content} if content else {})},
                "default": {"description": "An error, in OpenAI's shape",
                            "content": {"application/json":
                                        {"schema": ref_of[ErrorResponse]}}},
            },
        }
        if names := re.findall(r"{(\w+)}", path):
            operation["parameters"] = [{"name": name, "in": "path", "required": True,
                                        "schema": {"type": "string"}} for name in names]
        if request is not None:
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": ref_of[request]}}}
        if requires_api_key and path not in OPEN_PATHS:
            operation["security"] = [{"apiKey": []}]
        paths.setdefault(path, {})[method] = operation
    components: dict = {"schemas": schemas}
    if requires_api_key:
        components["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    document = {"openapi": "3.1.0",
                "info": {"title": "actorlm", "version": actorlm.__version__,
                         "description": "An OpenAI-compatible server (vLLM's extensions "
                                        "included)"},
                "paths": paths, "components": components}
    if root_path:
        document["servers"] = [{"url": root_path}]
    return document
