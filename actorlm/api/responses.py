"""What the API answers with: JSON bodies, OpenAI-shaped errors, and Server-Sent Events.

``as_api_error`` is the one place that decides what a client hears about an exception;
``EventStream`` streams encoded events and aborts the request when the client hangs up.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import AsyncIterator, Callable

import anyio
import msgspec
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from actorlm.api import protocol as p
from actorlm.api.errors import bad_request
from actorlm.async_llm import EngineDeadError, EngineOverloadedError, EngineShutdownError

log = logging.getLogger(__name__)
_json = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"
# a waiting request takes about a second to be scheduled under load: worth a retry by then
RETRY_AFTER_S = 1


def json_response(obj, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_json.encode(obj), status, headers, media_type="application/json")


def error_response(error: p.ApiError) -> Response:
    return json_response(error.response(), error.status, error.headers)


def as_api_error(exc: BaseException) -> p.ApiError:
    """What the client hears about an exception: 400 for its input, 503 for an engine that
    cannot take it now (overloaded, with ``Retry-After``; shutting down), 500 for a request the
    engine died under (new requests to a dead engine get the 503 of
    ``ServerState.ready_engine``), 500 (logged) for anything else."""
    if isinstance(exc, p.ApiError):
        return exc
    if isinstance(exc, (ValueError, msgspec.DecodeError)):
        return bad_request(exc)
    if isinstance(exc, EngineOverloadedError):
        return p.ApiError(503, str(exc), headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineShutdownError):
        return p.ApiError(503, str(exc))
    if isinstance(exc, ClientDisconnect):  # nobody is left to read the answer
        return p.ApiError(499, "the client disconnected")
    if isinstance(exc, EngineDeadError):
        return p.ApiError(500, str(exc))
    log.exception("internal error", exc_info=exc)
    return p.ApiError(500, f"internal error: {type(exc).__name__}: {exc}")


def event(obj) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


def error_event(exc: Exception, request_id: str) -> bytes:
    error = as_api_error(exc)
    log.log(logging.ERROR if error.status == 500 else logging.INFO, "%s: stream failed: %s",
            request_id, error.message)
    return event(error.response())


class EventStream(Response):
    """Server-Sent Events from an async iterator of encoded events. It listens for the client
    hanging up while it streams; either way it closes the iterator and calls ``on_close``.

    A stream silent for ``KEEP_ALIVE_S`` (a beam search streams nothing until it ends, a
    queued request nothing until its first token) sends an SSE comment, which clients skip:
    a client that hung up answers those bytes with a reset, and only then can the connection
    tell its hang-up from a half-close (``connection.GuardedH11Protocol``)."""

    media_type = "text/event-stream"
    KEEP_ALIVE_S = 1.0

    def __init__(self, events: AsyncIterator[bytes], on_close: Callable[[], None]):
        self.events, self.on_close = events, on_close
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        sending, last_sent, ended = anyio.Lock(), time.monotonic(), False

        async def write(body: bytes, more_body: bool = True) -> None:
            nonlocal last_sent, ended
            async with sending:  # one writer at a time; nothing after the last
                if not ended:
                    ended = not more_body
                    await send({"type": "http.response.body", "body": body,
                                "more_body": more_body})
                    last_sent = time.monotonic()

        async def stream() -> None:
            async for chunk in self.events:
                await write(chunk)
            await write(b"", more_body=False)

        async def keep_alive() -> None:
            while True:
                await anyio.sleep(max(0.0, last_sent + self.KEEP_ALIVE_S - time.monotonic()))
                if time.monotonic() - last_sent >= self.KEEP_ALIVE_S:
                    await write(b": keep-alive\n\n")

        async def listen() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        try:
            async with anyio.create_task_group() as group:
                async def run_then_cancel(fn) -> None:
                    with contextlib.suppress(OSError):  # the client left mid-send
                        await fn()
                    group.cancel_scope.cancel()

                group.start_soon(run_then_cancel, stream)
                group.start_soon(run_then_cancel, listen)
                group.start_soon(keep_alive)
        finally:
            with contextlib.suppress(Exception):
                await self.events.aclose()
            self.on_close()
