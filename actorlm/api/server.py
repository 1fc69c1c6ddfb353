"""The OpenAI-compatible HTTP server: a Starlette app over AsyncLLM, served by uvicorn.

Routes: ``/v1/completions`` and ``/v1/chat/completions`` (see ``serving``), ``/v1/models``,
``/health``, ``/metrics``, ``/version``, ``/tokenize`` and ``/detokenize``. Errors have OpenAI's
shape ``{"error": {"message", "type", "param", "code"}}``. The engine loads in the background,
so the port answers at once and ``/health`` says 503 until the engine is ready (and after a
fatal fault).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pathlib
import re
import time
from typing import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route
import uvicorn

import actorlm
from actorlm.api import protocol as p
from actorlm.api import serving
from actorlm.api.metrics import ServerMetrics, StatsLogger
from actorlm.api.responses import as_api_error, error_response, json_response
from actorlm.async_llm import AsyncLLM
from actorlm.trace import render_html

log = logging.getLogger(__name__)


# --- app state -----------------------------------------------------------------------------------


class ServerState:
    """The app's engine (built in the background when given a factory), name and metrics."""

    def __init__(self, engine: AsyncLLM | Callable[[], AsyncLLM], served_model_name: str | None,
                 log_stats_interval: float, on_load_error: Callable[[str], None] | None):
        self.factory = None if isinstance(engine, AsyncLLM) else engine
        self.engine: AsyncLLM | None = engine if isinstance(engine, AsyncLLM) else None
        self.served_model_name = served_model_name
        self.metrics: ServerMetrics | None = None
        self.log_stats_interval = log_stats_interval
        self.on_load_error = on_load_error
        self.load_error: str | None = None
        self.created = int(time.time())
        self._tasks: list[asyncio.Task] = []

    @property
    def model_name(self) -> str:
        return self.served_model_name or default_model_name(self.engine)

    def ready_engine(self) -> AsyncLLM:
        if self.engine is None:
            if self.load_error is not None:
                raise p.ApiError(503, f"the engine failed to start: {self.load_error}")
            raise p.ApiError(503, "the engine is still loading; retry shortly")
        problem = self.engine.check_health()
        if problem is not None:
            raise p.ApiError(503, f"the engine is not serving: {problem}")
        return self.engine

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise p.ApiError(404, f"The model `{model}` does not exist.", "model")

    async def start(self) -> None:
        if self.engine is None:
            self._tasks.append(asyncio.create_task(self._load()))
        else:
            self._engine_ready()

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.engine is not None and self.factory is not None:
            await asyncio.to_thread(self.engine.shutdown)

    async def _load(self) -> None:
        future = asyncio.get_running_loop().run_in_executor(None, self.factory)
        try:
            engine = await asyncio.shield(future)
        except asyncio.CancelledError:  # shut down while loading: stop it once it is built
            future.add_done_callback(lambda f: f.exception() or f.result().shutdown())
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

    def _engine_ready(self) -> None:
        self.metrics = ServerMetrics(self.model_name, lambda: self.engine)
        self.engine.stats_listener = self.metrics
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
    # the embedded default lives in a cache directory named "<gguf stem>-<file size>"
    return re.sub(r"-\d+$", "", engine.model_path.name)


def _state(request: Request) -> ServerState:
    return request.app.state.actorlm


# --- small endpoints -----------------------------------------------------------------------------


async def health(request: Request) -> Response:
    _state(request).ready_engine()
    return Response(status_code=200)


async def version(request: Request) -> Response:
    return json_response({"version": actorlm.__version__})


async def models(request: Request) -> Response:
    state = _state(request)
    engine = state.ready_engine()
    card = p.ModelCard(state.model_name, "model", state.created, "actorlm", str(engine.model_path),
                       engine.max_model_len)
    return json_response(p.ModelList("list", [card]))


async def metrics(request: Request) -> Response:
    state = _state(request)
    if state.metrics is None:
        state.ready_engine()  # says why
    body = await asyncio.to_thread(state.metrics.render)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


async def tokenize(request: Request) -> Response:
    state = _state(request)
    engine = state.ready_engine()
    req = p.decode(await request.body(), p.TokenizeRequest)
    state.check_model(req.model)
    if req.messages is not None:
        conversation = [m.as_dict(i) for i, m in enumerate(req.messages)]
        ids = await serving.apply_chat_template(engine, conversation,
                                                p.or_default(req.add_generation_prompt, True))
    elif req.prompt is not None:
        ids = await engine.run_blocking(engine.encode, req.prompt,
                                        p.or_default(req.add_special_tokens, True))
    else:
        raise p.ApiError(400, "either prompt or messages is required", "prompt")
    return json_response(p.TokenizeResponse(len(ids), engine.max_model_len, ids))


async def detokenize(request: Request) -> Response:
    state = _state(request)
    engine = state.ready_engine()
    req = p.decode(await request.body(), p.DetokenizeRequest)
    state.check_model(req.model)
    serving.check_token_ids(engine, req.tokens, "tokens")
    text = await engine.run_blocking(engine.decode, req.tokens)
    return json_response(p.DetokenizeResponse(text))


async def reset_prefix_cache(request: Request) -> Response:
    """Forget every cached prompt prefix (vLLM's route), e.g. after swapping weights."""
    await _state(request).ready_engine().reset_prefix_cache()
    return Response(status_code=200)


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
    return error_response(p.ApiError(exc.status_code, str(exc.detail)))


def create_app(engine: AsyncLLM | Callable[[], AsyncLLM], *, served_model_name: str | None = None,
               log_stats_interval: float = 10.0,
               on_load_error: Callable[[str], None] | None = None) -> Starlette:
    """The app over ``engine``: an AsyncLLM (the caller owns it) or a factory that builds one
    in the background at start-up (the app owns it and shuts it down)."""
    state = ServerState(engine, served_model_name, log_stats_interval, on_load_error)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await state.start()
        try:
            yield
        finally:
            await state.stop()

    routes = [
        Route("/health", _endpoint(health), methods=["GET"]),
        Route("/version", _endpoint(version), methods=["GET"]),
        Route("/metrics", _endpoint(metrics), methods=["GET"]),
        Route("/v1/models", _endpoint(models), methods=["GET"]),
        Route("/tokenize", _endpoint(tokenize), methods=["POST"]),
        Route("/detokenize", _endpoint(detokenize), methods=["POST"]),
        Route("/reset_prefix_cache", _endpoint(reset_prefix_cache), methods=["POST"]),
        Route("/trace", _endpoint(trace_page), methods=["GET"]),
        Route("/trace.json", _endpoint(trace_json), methods=["GET"]),
        Route("/v1/completions", _endpoint(_generation(serving.create_completion)),
              methods=["POST"]),
        Route("/v1/chat/completions", _endpoint(_generation(serving.create_chat_completion)),
              methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={HTTPException: _http_error})
    app.state.actorlm = state
    return app


def serve(model: str | None, engine_flags: dict, *, host: str = "127.0.0.1", port: int = 8000,
          served_model_name: str | None = None, max_num_waiting: int | None = None,
          log_stats_interval: float = 10.0, trace_file: str | None = None,
          shutdown_timeout: float = 5.0) -> int:
    """Run the server until SIGTERM or SIGINT, then stop gracefully (see ``_GracefulServer``)
    and return 0; the engine loads while the port already answers."""
    from actorlm.config import EngineConfig

    EngineConfig.from_flags(model, **engine_flags)  # bad flags fail now, not in the background
    if max_num_waiting is not None and max_num_waiting < 1:
        raise ValueError(f"--max-num-waiting must be at least 1, got {max_num_waiting}")
    if not shutdown_timeout >= 0:  # also refuses nan
        raise ValueError(f"--shutdown-timeout must be at least 0 seconds, got {shutdown_timeout}")
    failed: list[str] = []
    server: uvicorn.Server | None = None

    def on_load_error(message: str) -> None:
        failed.append(message)
        server.should_exit = True

    app = create_app(lambda: AsyncLLM(model, max_num_waiting=max_num_waiting,
                                      trace_file=trace_file, **engine_flags),
                     served_model_name=served_model_name, log_stats_interval=log_stats_interval,
                     on_load_error=on_load_error)
    config = uvicorn.Config(app, host=host, port=port, log_level="info")
    server = _GracefulServer(config, lambda: app.state.actorlm.engine, shutdown_timeout)
    try:
        server.run()
    except KeyboardInterrupt:  # Ctrl-C before uvicorn installed its handlers (or after)
        pass
    return 1 if failed else 0


class _GracefulServer(uvicorn.Server):
    """uvicorn that, on SIGTERM or SIGINT, stops accepting, gives in-flight requests
    ``shutdown_timeout`` seconds, then shuts the engine down: that fails the requests still
    running, so each stream ends with an error event and ``[DONE]`` and each non-streaming
    request with an error response, where uvicorn alone would cancel them mid-response (a
    dropped connection). Exits 0 either way."""

    # time for the failed requests to send their ending before uvicorn's own timeout cancels
    # whatever is left (a dropped connection)
    STREAM_END_MARGIN = 1.0

    def __init__(self, config: uvicorn.Config, engine: Callable[[], AsyncLLM | None],
                 shutdown_timeout: float):
        config.timeout_graceful_shutdown = shutdown_timeout + self.STREAM_END_MARGIN
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises a captured signal after its clean shutdown, so SIGTERM would kill
        # the process after all (status -15); a requested stop is a success
        self._captured_signals.clear()

    async def shutdown(self, sockets=None) -> None:
        # uvicorn closes the listeners and idle connections, then waits for the busy ones
        timer = asyncio.create_task(self._end_grace_period())
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    async def _end_grace_period(self) -> None:
        await asyncio.sleep(self.shutdown_timeout)
        if (engine := self.engine()) is not None:
            log.info("shutdown: failing the requests still running")
            await asyncio.to_thread(engine.shutdown)
