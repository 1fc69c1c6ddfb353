"""``actorlm serve``: the app under uvicorn, with the connection deadlines of ``connection``
and a graceful stop on SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import threading
from typing import Callable

import uvicorn

from actorlm.api.connection import GuardedH11Protocol
from actorlm.api.lora_models import LoRAModulePath, check_lora_modules
from actorlm.api.options import ServerOptions
from actorlm.api.server import create_app
from actorlm.async_llm import AsyncLLM

log = logging.getLogger(__name__)


def serve(model: str | None, engine_flags: dict, *, host: str = "127.0.0.1", port: int = 8000,
          served_model_name: str | list[str] | None = None, max_num_waiting: int | None = None,
          log_stats_interval: float | None = 10.0, uvicorn_log_level: str = "info",
          trace_file: str | None = None,
          shutdown_timeout: float = 5.0, options: ServerOptions | None = None,
          lora_modules: list[LoRAModulePath] = ()) -> int:
    """Run the server until SIGTERM or SIGINT, then stop gracefully (see ``_GracefulServer``)
    and return 0; the engine loads while the port already answers, then ``lora_modules``.
    ``log_stats_interval`` None: no periodic stats lines."""
    from actorlm.config import EngineConfig

    options = dataclasses.replace(options or ServerOptions(), host=host)
    # The engine core in a process of its own by default (vLLM's layout): the server's event
    # loop, the frontend and the detokenizer share no GIL with the scheduler and the model's
    # Python, and a core that dies is restarted with its requests resumed
    engine_flags = {"engine_core_process": True, **engine_flags}
    config = EngineConfig.from_flags(model, **engine_flags)  # bad flags fail now, not later
    check_lora_modules(lora_modules, config.enable_lora)
    if max_num_waiting is not None and max_num_waiting < 1:
        raise ValueError(f"--max-num-waiting must be at least 1, got {max_num_waiting}")
    if log_stats_interval is not None and not log_stats_interval > 0:
        raise ValueError(f"--log-stats-interval must be above 0 seconds, got "
                         f"{log_stats_interval} (--disable-log-stats turns the lines off)")
    if not shutdown_timeout >= 0:  # also refuses nan
        raise ValueError(f"--shutdown-timeout must be at least 0 seconds, got {shutdown_timeout}")
    failed: list[str] = []
    server: uvicorn.Server | None = None

    def on_load_error(message: str) -> None:
        failed.append(message)
        server.should_exit = True

    cancel_load = threading.Event()  # a SIGTERM while the model loads stops the load
    app = create_app(lambda: AsyncLLM(model, max_num_waiting=max_num_waiting,
                                      trace_file=trace_file, cancel_load=cancel_load,
                                      **engine_flags),
                     served_model_name=served_model_name, log_stats_interval=log_stats_interval,
                     on_load_error=on_load_error, options=options, lora_modules=lora_modules,
                     cancel_load=cancel_load)
    if not options.api_keys and not options.binds_loopback:
        log.warning("serving on %s without an API key: anyone who reaches the port may use "
                    "it (--api-key)", host)
    protocol = functools.partial(GuardedH11Protocol, client_timeout=options.client_timeout)
    config = uvicorn.Config(app, host=host, port=port, log_level=uvicorn_log_level,
                            http=protocol, access_log=options.access_log,
                            ssl_keyfile=options.ssl_keyfile, ssl_certfile=options.ssl_certfile,
                            root_path=options.root_path)
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
