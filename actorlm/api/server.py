"""The OpenAI-compatible HTTP server: a Starlette app over AsyncLLM, served by uvicorn.

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (see ``serving``) for a model that
generates, ``/v1/embeddings`` and ``/pooling`` (``embeddings``), ``/classify``, ``/score``
and ``/rerank`` (``scoring``; vLLM's, with their ``/v1``/``/v2`` aliases) for a pooling one,
``/v1/models``, ``/health``, ``/metrics``, ``/version``, ``/tokenize``, ``/detokenize``,
``/reset_prefix_cache``, ``/openapi.json``, the trace, SageMaker's ``/ping`` and
``/invocations`` (a chat, completions or embeddings body, told apart by its fields), and with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``
(``lora_routes``; a request's ``model`` names the base model or an adapter, ``lora_models``).
Errors have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``. Before a route
sees a request it passes ``security.RequestGuard`` (Host, API key, content type, body size)
and, when the operator allows origins, CORS; uvicorn's connections get the deadlines of
``connection``. The engine loads in the background, so the port answers at once and
``/health`` says 503 until the engine is ready (and after a fatal fault).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from typing import Callable, Sequence

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

import actorlm
from actorlm.api import protocol as p
from actorlm.api import serving
from actorlm.api.chat_template import apply_chat_template, template_call
from actorlm.api.embeddings import create_embedding, create_pooling
from actorlm.api.lora_models import LoRAModulePath, runtime_updating_allowed
from actorlm.api.lora_routes import load_lora_adapter, unload_lora_adapter
from actorlm.api.options import ServerOptions
from actorlm.api.prompt_limits import check_token_ids
from actorlm.api.responses import as_api_error, error_response, json_response
from actorlm.api.responses_api import (cancel_response, create_response, delete_response,
                                       list_input_items, retrieve_response)
from actorlm.api.scoring import (RERANK_PATHS, SCORE_PATHS, create_classification, create_rerank,
                                 create_score)
from actorlm.api.security import RequestGuard
from actorlm.api.server_state import ServerState
from actorlm.api.user_middleware import user_middleware
from actorlm.async_llm import AsyncLLM
from actorlm.trace import render_html

log = logging.getLogger(__name__)


def _state(request: Request) -> ServerState:
    return request.app.state.actorlm


# --- small endpoints -----------------------------------------------------------------------------


async def health(request: Request) -> Response:
    _state(request).ready_engine()
    return Response(status_code=200)


# SageMaker's: /invocations takes a body of any of these APIs, told apart by the field each
# needs (vLLM's order: chat, completions, embeddings); /ping is /health
_INVOCATIONS = (("messages", serving.create_chat_completion),
                ("prompt", serving.create_completion), ("input", create_embedding))


async def invocations(state: ServerState, request: Request) -> Response:
    try:
        fields = msgspec.json.decode(await request.body(), type=dict[str, msgspec.Raw])
    except msgspec.DecodeError:
        fields = {}  # (the API it goes to would say why; with none, the 400 below does)
    for field, create in _INVOCATIONS:
        if field in fields:
            return await create(state, request)
    raise p.ApiError(400, "/invocations: the body is none of a chat request (messages), a "
                          "completions request (prompt) or an embeddings request (input)")


async def version(request: Request) -> Response:
    return json_response({"version": actorlm.__version__})


async def models(request: Request) -> Response:
    state = _state(request)
    engine = state.ready_engine()
    cards = [p.ModelCard(name, "model", state.created, "actorlm", str(engine.model_path),
                         engine.max_model_len) for name in state.base_model_names]
    adapters = state.lora.cards(state.model_name, state.created)
    return json_response(p.ModelList("list", [*cards, *adapters]))


async def metrics(request: Request) -> Response:
    state = _state(request)
    if state.metrics is None:
        state.ready_engine()  # says why
    body = await asyncio.to_thread(state.metrics.render)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


async def tokenize(request: Request) -> Response:
    state = _state(request)
    engine = state.ready_engine()
    req = state.decoder.decode(await request.body(), p.TokenizeRequest)
    state.check_model(req.model)
    if req.messages is not None:
        add_generation_prompt, kwargs = template_call(req, state.options, True)
        if req.tools:
            kwargs["tools"] = [t.as_dict() for t in req.tools]
        ids = await apply_chat_template(engine, p.conversation(req.messages),
                                        add_generation_prompt, **kwargs)
    elif req.prompt is not None:
        ids = await engine.run_blocking(engine.encode, req.prompt,
                                        p.or_default(req.add_special_tokens, True))
    else:
        raise p.ApiError(400, "either prompt or messages is required", "prompt")
    strings = engine.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return json_response(p.TokenizeResponse(len(ids), engine.max_model_len, ids, strings))


async def detokenize(request: Request) -> Response:
    state = _state(request)
    engine = state.ready_engine()
    req = state.decoder.decode(await request.body(), p.DetokenizeRequest)
    state.check_model(req.model)
    check_token_ids(engine, req.tokens, "tokens")
    text = await engine.run_blocking(engine.decode, req.tokens)
    return json_response(p.DetokenizeResponse(text))


async def reset_prefix_cache(request: Request) -> Response:
    """Forget every cached prompt prefix (vLLM's route), e.g. after swapping weights."""
    await _state(request).ready_engine().reset_prefix_cache()
    return Response(status_code=200)


async def load(request: Request) -> Response:
    return json_response({"server_load": _state(request).server_load})


async def openapi(request: Request) -> Response:
    return json_response(_state(request).openapi)


async def trace_page(request: Request) -> Response:
    """The live visualizer over what the ring buffer holds now (rendered off the loop)."""
    engine = _state(request).ready_engine()
    page = await asyncio.to_thread(render_html, engine.trace.records(), "actorlm trace (live)")
    return HTMLResponse(page)


async def trace_json(request: Request) -> Response:
    """The same JSON lines as --trace-file: the configuration first, then the records."""
    engine = _state(request).ready_engine()
    engine.trace.flush()  # keep --trace-file current as well
    lines = await asyncio.to_thread(engine.trace.jsonl_lines)
    return Response("\n".join(lines) + "\n", media_type="application/x-ndjson")


# --- the app -------------------------------------------------------------------------------------


def _endpoint(fn):
    async def handler(request: Request) -> Response:
        try:
            return await fn(request)
        except Exception as exc:
            return error_response(as_api_error(exc))
    handler.__name__ = fn.__name__
    return handler


def _generation(fn):
    async def handler(request: Request) -> Response:
        return await fn(_state(request), request)
    handler.__name__ = fn.__name__
    return handler


def _counted(fn):
    """``_generation`` for a route that runs the model: counted in /load's ``server_load``
    from its arrival to its answer's last byte (a stream's end, or its client hanging up)."""
    async def handler(request: Request) -> Response:
        state = _state(request)
        state.server_load += 1
        try:
            response = await fn(state, request)
        except BaseException:
            state.server_load -= 1
            raise
        return _Sent(response, state)
    handler.__name__ = fn.__name__
    return handler


class _Sent:
    """An answer that, once sent (or abandoned), takes its request off the server's load."""

    def __init__(self, response: Response, state: ServerState):
        self.response, self.state = response, state

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.state.server_load -= 1


async def _http_error(request: Request, exc: HTTPException) -> Response:
    return error_response(p.ApiError(exc.status_code, str(exc.detail), headers=exc.headers))


def create_app(engine: AsyncLLM | Callable[[], AsyncLLM], *,
               served_model_name: str | Sequence[str] | None = None,
               log_stats_interval: float | None = 10.0,
               on_load_error: Callable[[str], None] | None = None,
               options: ServerOptions | None = None,
               lora_modules: list[LoRAModulePath] = (),
               cancel_load: threading.Event | None = None) -> Starlette:
    """The app over ``engine``: an AsyncLLM (the caller owns it) or a factory that builds one
    in the background at start-up (the app owns it and shuts it down; if it stops first, it
    sets ``cancel_load``, the event the factory gave ``AsyncLLM``). ``lora_modules`` are
    served by name from the start; the runtime LoRA routes exist when
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is true now."""
    options = options or ServerOptions()
    runtime_lora = runtime_updating_allowed()
    state = ServerState(engine, served_model_name, log_stats_interval, on_load_error, options,
                        lora_modules, runtime_lora, cancel_load)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    routes = [
        Route("/health", _endpoint(health), methods=["GET"]),
        Route("/ping", _endpoint(health), methods=["GET", "POST"]),
        Route("/invocations", _endpoint(_counted(invocations)), methods=["POST"]),
        Route("/version", _endpoint(version), methods=["GET"]),
        Route("/load", _endpoint(load), methods=["GET"]),
        Route("/metrics", _endpoint(metrics), methods=["GET"]),
        Route("/v1/models", _endpoint(models), methods=["GET"]),
        Route("/tokenize", _endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", _endpoint(detokenize), methods=["POST"]),
        Route("/reset_prefix_cache", _endpoint(reset_prefix_cache), methods=["POST"]),
        Route("/trace", _endpoint(trace_page), methods=["GET"]),
        Route("/trace.json", _endpoint(trace_json), methods=["GET"]),
        Route("/v1/completions", _endpoint(_counted(serving.create_completion)),
              methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(_counted(serving.create_chat_completion)),
              methods=["POST"]),
        Route("/v1/responses", _endpoint(_counted(create_response)), methods=["POST"]),
        Route("/v1/responses/{response_id}", _endpoint(_generation(retrieve_response)),
              methods=["GET"]),
        Route("/v1/responses/{response_id}", _endpoint(_generation(delete_response)),
              methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", _endpoint(_generation(cancel_response)),
              methods=["POST"]),
        Route("/v1/responses/{response_id}/input_items",
              _endpoint(_generation(list_input_items)), methods=["GET"]),
        Route("/v1/embeddings", _endpoint(_counted(create_embedding)), methods=["POST"]),
        Route("/classify", _endpoint(_counted(create_classification)), methods=["POST"]),
        Route("/pooling", _endpoint(_counted(create_pooling)), methods=["POST"]),
        *[Route(path, _endpoint(_counted(create_score)), methods=["POST"])
          for path in SCORE_PATHS],
        *[Route(path, _endpoint(_counted(create_rerank)), methods=["POST"])
          for path in RERANK_PATHS],
    ]
    if options.openapi:
        routes.append(Route("/openapi.json", _endpoint(openapi), methods=["GET"]))
    if runtime_lora:
        log.warning("LoRA dynamic loading & unloading is enabled in the API server "
                    "(%s). This should ONLY be used for local development!",
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING")
        routes += [
            Route("/v1/load_lora_adapter", _endpoint(_generation(load_lora_adapter)),
                  methods=["POST"]),
            Route("/v1/unload_lora_adapter", _endpoint(_generation(unload_lora_adapter)),
                  methods=["POST"]),
        ]
    # CORS outside the guard: a preflight carries no API key, and a refusal must reach the
    # page; the operator's own middleware outside both, as vLLM adds it
    middleware = [Middleware(RequestGuard, options=options)]
    if options.allowed_origins:
        middleware.insert(0, Middleware(
            CORSMiddleware, allow_origins=list(options.allowed_origins),
            allow_methods=list(options.allowed_methods),
            allow_headers=list(options.allowed_headers), expose_headers=["X-Request-Id"]))
    middleware[:0] = [user_middleware(path) for path in options.middleware]
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: _http_error})
    app.state.actorlm = state
    return app
