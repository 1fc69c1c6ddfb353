"""The server's state: its engine (built in the background when given a factory), the names
the base model is served by, the LoRA adapters, the metrics, the operator's options, the
request decoder and the Responses API's stored answers (``ServerState``)."""

from __future__ import annotations

import asyncio
import logging
import pathlib
import threading
import time
from typing import Callable, Sequence

from actorlm.api import protocol as p
from actorlm.api.lora_models import LoRAModels, LoRAModulePath
from actorlm.api.metrics import ServerMetrics, StatsLogger
from actorlm.api.openapi import openapi_document
from actorlm.api.options import ServerOptions
from actorlm.api.request_body import RequestDecoder
from actorlm.api.responses_api import ResponseStore
from actorlm.async_llm import AsyncLLM
from actorlm.lora_request import LoRARequest
from actorlm.models import gguf_file
from actorlm.models.lora_adapter import lora_checker

log = logging.getLogger(__name__)



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
        self.openapi = openapi_document(bool(options.api_keys), runtime_lora,
                                        options.root_path)
        self.server_load = 0  # requests from their arrival to their answer's last byte
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
        model nobody serves. Without ``--served-model-name`` the model as given names it too
        (vLLM serves ``vllm serve ./my-model`` as ``./my-model``, and its users' clients name
        it so), though it is listed by its directory's name."""
        given = None if self.served_names or self.engine is None else self.engine.config.model
        return self.lora.resolve(model, self.base_model_names + ((given,) if given else ()))

    def check_model(self, model: str | None) -> None:
        self.resolve_model(model)  # (the base model's tokenizer serves its adapters too)

    async def start(self) -> None:
        if self.engine is None:
            self._tasks.append(asyncio.create_task(self._load()))
        else:
            self._check_engine(self.engine)
            self.max_token_chars = await asyncio.to_thread(max_token_chars, self.engine)
            await asyncio.to_thread(self._load_lora_modules, self.engine)
            self._engine_ready()

    async def stop(self) -> None:
        if self.engine is None and self.cancel_load is not None:
            self.cancel_load.set()  # (a load still running ends now, not when it would finish)
        for task in self._tasks:
            task.cancel()
        self.responses.cancel_running()
        if self.engine is not None and self.factory is not None:
            await asyncio.to_thread(self.engine.shutdown)

    async def _load(self) -> None:
        def build() -> tuple[AsyncLLM, int]:
            engine = self.factory()
            try:
                self._check_engine(engine)
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

    def _check_engine(self, engine: AsyncLLM) -> None:
        """The options against the engine they serve: GPT-OSS's tool calls need its harmony
        reasoning parser (which the command line implies; an engine built apart may lack it)."""
        given = engine.config.reasoning_parser
        if (wanted := self.options.reasoning_parser_for(given)) != given:
            raise ValueError(f"--tool-call-parser {self.options.tool_call_parser} needs the "
                             f"engine's --reasoning-parser {wanted}, which it has not")

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
        path = pathlib.Path(engine.config.model).expanduser()
        if not path.exists():  # a Hub repository id: served under it, as vLLM serves it
            return engine.config.model
        return path.stem if path.suffix == ".gguf" else path.name
    return gguf_file.model_name(engine.model_path)  # the embedded default: its GGUF's stem


def max_token_chars(engine: AsyncLLM) -> int:
    """The most characters one token can stand for: no more than its vocabulary entry has (a
    byte-level entry has one character per byte, a SentencePiece one one per character or a
    byte's ``<0xNN>``). Blocking: call it off the event loop."""
    return max(map(len, engine.tokenizer.get_vocab()))
