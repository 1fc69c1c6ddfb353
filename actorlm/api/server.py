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
import pathlib
import threading
import time
from typing import Callable, Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

import msgspec

import actorlm
from actorlm.api import protocol as p
from actorlm.api import serving
from actorlm.api.chat_template import apply_chat_template, template_call
from actorlm.api.embeddings import create_embedding, create_pooling
from actorlm.api.lora_models import LoRAModels, LoRAModulePath, runtime_updating_allowed
from actorlm.api.lora_routes import load_lora_adapter, unload_lora_adapter
from actorlm.api.request_body import RequestDecoder
from actorlm.api.metrics import ServerMetrics, StatsLogger
from actorlm.api.openapi import openapi_document
from actorlm.api.options import ServerOptions
from actorlm.api.prompt_limits import check_token_ids
from actorlm.api.responses import as_api_error, error_response, json_response
from actorlm.api.responses_api import (ResponseStore, create_response, delete_response,
                                       retrieve_response)
from actorlm.api.scoring import (RERANK_PATHS, SCORE_PATHS, create_classification, create_rerank,
                                 create_score)
from actorlm.api.security import RequestGuard
from actorlm.async_llm import AsyncLLM
from actorlm.lora_request import LoRARequest
from actorlm.models import gguf_file
from actorlm.models.lora_adapter import lora_checker
from actorlm.trace import render_html

log = logging.getLogger(__name__)


# --- app state -----------------------------------------------------------------------------------


class ServerState:
    """The app's engine (built in the background when given a factory), name, LoRA adapters,
    metrics, options and request decoder."""

    def __init__(self, engine: AsyncLLM | Callable[[], AsyncLLM],
                 served_model_name: str | Sequence[str] | None,
                 log_stats_interval: float | None, on_load_error: Callable[[str], None] | None,
                 options: ServerOptions, lora_modules: list[LoRAModulePath] = (),
                 runtime_lora: bool = False, cancel_load: threading.Event | None = None):
        self.options = options
        self.cancel_load = cancel_load
        self.lora = LoRAModels()  # its checker comes with the engine
        self.lora_modules = list(lora_modules)  # loaded once the engine is, before serving
        self.decoder = RequestDecoder()
        self.responses = ResponseStore()  # the Responses API's stored answers
        self.openapi = openapi_document(bool(options.api_keys), runtime_lora)
        self.max_token_chars = 0  # the longest text one token stands for; set when ready
        self.factory = None if isinstance(engine, AsyncLLM) else engine
        self.engine: AsyncLLM | None = engine if isinstance(engine, AsyncLLM) else None
        # the names requests may give the base model by (vLLM's --served-model-name takes
        # several); answers carry the first. None: the model directory's name
        self.served_names = (served_model_name,) if isinstance(served_model_name, str) else \
            tuple(served_model_name or ())
        self.served_model_name = self.served_names[0] if self.served_names else None
        self.metrics: ServerMetrics | None = None
        self.log_stats_interval = log_stats_interval
        self.on_load_error = on_load_error
        self.load_error: str | None = None
        self.created = int(time.time())
        self._tasks: list[asyncio.Task] = []

    @property
    def model_name(self) -> str:
        return self.served_model_name or default_model_name(self.engine)

    @property
    def base_model_names(self) -> tuple[str, ...]:
        return self.served_names or (self.model_name,)

    def ready_engine(self) -> AsyncLLM:
        if self.engine is None:
            if self.load_error is not None:
                raise p.ApiError(503, f"the engine failed to start: {self.load_error}")
            raise p.ApiError(503, "the engine is still loading; retry shortly")
        problem = self.engine.check_health()
        if problem is not None:
            raise p.ApiError(503, f"the engine is not serving: {problem}")
        return self.engine

    def resolve_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model; a 404 for a
        model nobody serves."""
        return self.lora.resolve(model, self.base_model_names)

    def check_model(self, model: str | None) -> None:
        self.resolve_model(model)  # (the base model's tokenizer serves its adapters too)

    async def start(self) -> None:
        if self.engine is None:
            self._tasks.append(asyncio.create_task(self._load()))
        else:
            self.max_token_chars = await asyncio.to_thread(max_token_chars, self.engine)
            await asyncio.to_thread(self._load_lora_modules, self.engine)
            self._engine_ready()

    async def stop(self) -> None:
        if self.engine is None and self.cancel_load is not None:
            self.cancel_load.set()  # (a load still running ends now, not when it would finish)
        for task in self._tasks:
            task.cancel()
        if self.engine is not None and self.factory is not None:
            await asyncio.to_thread(self.engine.shutdown)

    async def _load(self) -> None:
        def build() -> tuple[AsyncLLM, int]:
            engine = self.factory()
            try:
                self._load_lora_modules(engine)
            except BaseException:
                engine.shutdown()
                raise
            return engine, max_token_chars(engine)

        future = asyncio.get_running_loop().run_in_executor(None, build)
        try:
            engine, self.max_token_chars = await asyncio.shield(future)
        except asyncio.CancelledError:  # shut down while loading: cancelled (``stop``), or
            # stopped once built where it cannot be (a core in this process)
            future.add_done_callback(lambda f: f.exception() or f.result()[0].shutdown())
            raise
        except Exception as exc:
            self.load_error = str(exc)
            log.error("the engine failed to start: %s", exc,
                      exc_info=not isinstance(exc, ValueError))
            if self.on_load_error is not None:
                self.on_load_error(self.load_error)
            return
        self.engine = engine
        self._engine_ready()

    def _load_lora_modules(self, engine: AsyncLLM) -> None:
        """The checker of ``engine``'s adapters, then ``--lora-modules`` (blocking)."""
        self.lora.checker = lora_checker(engine.config, engine.engine.hf_config)
        if self.lora_modules:
            self.lora.load_static(self.lora_modules,
                                  self.served_names or (default_model_name(engine),))

    def _engine_ready(self) -> None:
        self.metrics = ServerMetrics(self.model_name, lambda: self.engine)
        self.engine.stats_listener = self.metrics
        if self.log_stats_interval is not None:
            logger = StatsLogger(lambda: self.engine, self.metrics, self.log_stats_interval)
            self._tasks.append(asyncio.create_task(logger.run()))
        log.info("serving %s as %r", self.engine.model_path, self.model_name)


def default_model_name(engine: AsyncLLM | None) -> str:
    """The name a model is served under by default: the name of the directory (or GGUF file)."""
    if engine is None:
        return "unknown"
    if engine.config.model:
        path = pathlib.Path(engine.config.model)
        return path.stem if path.suffix == ".gguf" else path.name
    return gguf_file.model_name(engine.model_path)  # the embedded default: its GGUF's stem


def max_token_chars(engine: AsyncLLM) -> int:
    """The most characters one token can stand for: no more than its vocabulary entry has (a
    byte-level entry has one character per byte, a SentencePiece one one per character or a
    byte's ``<0xNN>``). Blocking: call it off the event loop."""
    return max(map(len, engine.tokenizer.get_vocab()))


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
    return json_response(p.TokenizeResponse(len(ids), engine.max_model_len, ids))


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
        Route("/invocations", _endpoint(_generation(invocations)), methods=["POST"]),
        Route("/version", _endpoint(version), methods=["GET"]),
        Route("/metrics", _endpoint(metrics), methods=["GET"]),
        Route("/v1/models", _endpoint(models), methods=["GET"]),
        Route("/tokenize", _endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", _endpoint(detokenize), methods=["POST"]),
        Route("/reset_prefix_cache", _endpoint(reset_prefix_cache), methods=["POST"]),
        Route("/trace", _endpoint(trace_page), methods=["GET"]),
        Route("/trace.json", _endpoint(trace_json), methods=["GET"]),
        Route("/openapi.json", _endpoint(openapi), methods=["GET"]),
        Route("/v1/completions", _endpoint(_generation(serving.create_completion)),
              methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(_generation(serving.create_chat_completion)),
              methods=["POST"]),
        Route("/v1/responses", _endpoint(_generation(create_response)), methods=["POST"]),
        Route("/v1/responses/{response_id}", _endpoint(_generation(retrieve_response)),
              methods=["GET"]),
        Route("/v1/responses/{response_id}", _endpoint(_generation(delete_response)),
              methods=["DELETE"]),
        Route("/v1/embeddings", _endpoint(_generation(create_embedding)), methods=["POST"]),
        Route("/classify", _endpoint(_generation(create_classification)), methods=["POST"]),
        Route("/pooling", _endpoint(_generation(create_pooling)), methods=["POST"]),
        *[Route(path, _endpoint(_generation(create_score)), methods=["POST"])
          for path in SCORE_PATHS],
        *[Route(path, _endpoint(_generation(create_rerank)), methods=["POST"])
          for path in RERANK_PATHS],
    ]
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
    # CORS outermost: a preflight carries no API key, and a refusal must reach the page
    middleware = [Middleware(RequestGuard, options=options)]
    if options.allowed_origins:
        middleware.insert(0, Middleware(
            CORSMiddleware, allow_origins=list(options.allowed_origins),
            allow_methods=list(options.allowed_methods),
            allow_headers=list(options.allowed_headers), expose_headers=["X-Request-Id"]))
    app = Starlette(routes=routes, lifespan=lifespan, middleware=middleware,
                    exception_handlers={HTTPException: _http_error})
    app.state.actorlm = state
    return app
