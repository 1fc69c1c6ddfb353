"""A burst, and the deadline it exposed.

The burst, on the guarded server (a one-second client timeout): 300 connections opened at once,
then each sends one complete request at the same moment: completions and chats (some streamed)
mixed with malformed JSON, fields of the wrong type, an unknown model and values too large for
the context. Every connection must get an HTTP answer: none dropped, none 5xx, each valid
request its whole completion, each invalid one a 4xx in OpenAI's error shape.

A busy loop runs a due deadline late, and a request that arrived meanwhile lies unread in the
socket: the deadline must not take that for silence. The last tests hold the loop off a socket
(its transport paused) while the deadline runs out. Figures: docs/reliability.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import h11
import uvicorn
from api_helpers import SERVED_NAME
from conftest import API_KEY
from uvicorn.server import ServerState

from actorlm.api.connection import GuardedH11Protocol

NUM_CONNECTIONS = 300
MAX_TOKENS = 4
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Once upon a time"}]


def _json(**fields) -> bytes:
    return json.dumps(fields).encode()


def _valid(**fields) -> bytes:
    return _json(model=SERVED_NAME, max_tokens=MAX_TOKENS, ignore_eos=True, **fields)


# (kind, path, body, the status it must get): four kinds of nine valid
CASES = [
    ("completion", CMPL, _valid(prompt="Once upon a time"), 200),
    ("malformed-json", CMPL, b'{"model": "' + SERVED_NAME.encode() + b'", "prompt": "x",', 400),
    ("wrong-type", CHAT, _json(model=SERVED_NAME, messages=MESSAGES, max_tokens="four"), 400),
    ("chat", CHAT, _valid(messages=MESSAGES), 200),
    ("unknown-model", CMPL, _json(model="gpt-17", prompt="x", max_tokens=MAX_TOKENS), 404),
    ("too-many-tokens", CHAT, _json(model=SERVED_NAME, messages=MESSAGES, max_tokens=10**12),
     400),
    ("stream", CMPL, _valid(prompt="The quick brown fox", stream=True,
                            stream_options={"include_usage": True}), 200),
    ("prompt-too-long", CMPL, _json(model=SERVED_NAME, prompt="fox " * 2000, max_tokens=1),
     400),
    ("chat-stream", CHAT, _valid(messages=MESSAGES, stream=True,
                                 stream_options={"include_usage": True}), 200),
]


class Outcome:
    """What one connection got back: a status (None: no response at all), the final body,
    and what went wrong on the wire, if anything."""

    def __init__(self, status: int | None, body: bytes, error: str | None):
        self.status, self.body, self.error = status, body, error


def _request(path: str, body: bytes) -> tuple[h11.Connection, bytes]:
    conn = h11.Connection(h11.CLIENT)
    headers = [("Host", "127.0.0.1"), ("Authorization", f"Bearer {API_KEY}"),
               ("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    return conn, (conn.send(h11.Request(method="POST", target=path, headers=headers))
                  + conn.send(h11.Data(data=body)) + conn.send(h11.EndOfMessage()))


async def _read_answer(conn: h11.Connection, reader: asyncio.StreamReader) -> Outcome:
    """The final response to the request ``conn`` sent (interim ones skipped)."""
    status, answer = None, b""
    try:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await reader.read(65536))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                answer += event.data
            elif isinstance(event, h11.EndOfMessage):
                return Outcome(status, answer, None)
            elif isinstance(event, h11.ConnectionClosed):
                return Outcome(status, answer, "closed")
    except (h11.RemoteProtocolError, OSError) as exc:  # closed without (or mid-) answer
        return Outcome(status, answer, f"{type(exc).__name__}: {exc}")


async def _exchange(port: int, path: str, body: bytes, go: asyncio.Event,
                    num_connected: list[int]) -> Outcome:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    num_connected[0] += 1
    conn, request = _request(path, body)
    try:
        await go.wait()  # every connection is open: now all of them send
        writer.write(request)
        return await _read_answer(conn, reader)
    finally:
        writer.close()


async def _burst(port: int, cases: list[tuple[str, str, bytes, int]]) -> tuple[list, float]:
    go, num_connected = asyncio.Event(), [0]
    tasks = [asyncio.create_task(_exchange(port, path, body, go, num_connected))
             for _, path, body, _ in cases]
    start = time.monotonic()
    while num_connected[0] < len(cases):
        await asyncio.sleep(0.001)
    seconds_to_connect = time.monotonic() - start  # the first ones' silence: well under 1 s
    go.set()
    return await asyncio.wait_for(asyncio.gather(*tasks), timeout=120), seconds_to_connect


def burst(base: str, num_connections: int = NUM_CONNECTIONS) -> tuple[list, list[Outcome], float]:
    """(the case of each connection, what it got, the seconds it took to open them all) for
    ``num_connections`` at once."""
    cases = [CASES[i % len(CASES)] for i in range(num_connections)]
    outcomes, seconds_to_connect = asyncio.run(_burst(int(base.rsplit(":", 1)[1]), cases))
    return cases, outcomes, seconds_to_connect


def _check(kind: str, expected: int, outcome: Outcome) -> None:
    assert (outcome.status, outcome.error) == (expected, None), (kind, outcome.status,
                                                                 outcome.error, outcome.body[:300])
    if expected != 200:
        error = json.loads(outcome.body)["error"]
        assert error["code"] == expected and error["message"] and error["type"], error
        return
    if kind.endswith("stream"):
        events = [e.removeprefix(b"data: ") for e in outcome.body.split(b"\n\n") if e]
        assert events[-1] == b"[DONE]", events[-2:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in chunk for chunk in chunks), chunks
        finishes = [c["finish_reason"] for chunk in chunks for c in chunk["choices"]]
        usage = chunks[-1]["usage"]
    else:
        answer = json.loads(outcome.body)
        finishes, usage = [c["finish_reason"] for c in answer["choices"]], answer["usage"]
    assert finishes[-1] == "length" and usage["completion_tokens"] == MAX_TOKENS, (kind, usage)


def test_every_connection_of_a_burst_is_answered(guarded):
    start = time.monotonic()
    cases, outcomes, seconds_to_connect = burst(guarded)
    seconds = time.monotonic() - start
    statuses = [o.status for o in outcomes]
    dropped = [o.error for o in outcomes if o.status is None]
    print(f"burst: {len(outcomes)} connections opened in {seconds_to_connect:.2f} s, answered "
          f"in {seconds:.1f} s, {len(dropped)} dropped, statuses {sorted(set(statuses) - {None})}")
    assert not dropped, (seconds_to_connect, dropped[:5])
    assert not [s for s in statuses if s >= 500]
    for (kind, _, _, expected), outcome in zip(cases, outcomes):
        _check(kind, expected, outcome)


# --- the deadline with a request unread ----------------------------------------------------------


async def _echo(scope, receive, send) -> None:
    body, more = b"", True
    while more:
        message = await receive()
        body, more = body + message.get("body", b""), message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def _echo_server(client_timeout: float, keep_alive: float = 5.0):
    """(port, the connections made so far) of an echo app behind actorlm's connections, on
    this loop."""
    config = uvicorn.Config(_echo, log_level="warning", timeout_keep_alive=keep_alive)
    config.load()
    server_state, connections = ServerState(), []

    def connection() -> GuardedH11Protocol:
        connections.append(GuardedH11Protocol(config=config, server_state=server_state,
                                              app_state={}, client_timeout=client_timeout))
        return connections[-1]

    server = await asyncio.get_running_loop().create_server(connection, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], connections
    finally:
        server.close()
        for protocol in connections:
            protocol.transport.close()
        await asyncio.sleep(0.05)  # the transports' close callbacks


async def _connect(port: int, connections: list) -> tuple:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    while not connections or connections[-1].transport is None:
        await asyncio.sleep(0.005)
    return reader, writer, connections[-1]


async def _unread_while(protocol, writer, data: bytes, seconds: float) -> None:
    """Send ``data`` while the server's loop does not read the socket, for ``seconds``."""
    protocol.transport.pause_reading()  # as a busy loop that has not come to the socket
    writer.write(data)
    await asyncio.sleep(seconds)
    protocol.transport.resume_reading()


def test_a_request_lying_unread_at_the_deadline_is_answered():
    async def main() -> Outcome:
        async with _echo_server(client_timeout=0.2) as (port, connections):
            reader, writer, protocol = await _connect(port, connections)
            conn, request = _request("/echo", b"hello")
            await _unread_while(protocol, writer, request, 0.5)  # two deadlines go by
            outcome = await asyncio.wait_for(_read_answer(conn, reader), 5)
            writer.close()
            return outcome

    outcome = asyncio.run(main())
    assert (outcome.status, outcome.body, outcome.error) == (200, b"hello", None)


def test_a_next_request_lying_unread_at_the_keep_alive_timeout_is_answered():
    async def main() -> list[Outcome]:
        async with _echo_server(client_timeout=5.0, keep_alive=0.2) as (port, connections):
            reader, writer, protocol = await _connect(port, connections)
            conn, request = _request("/echo", b"one")
            writer.write(request)
            first = await asyncio.wait_for(_read_answer(conn, reader), 5)
            conn.start_next_cycle()
            request = (conn.send(h11.Request(method="POST", target="/echo", headers=[
                ("Host", "x"), ("Content-Length", "3")])) + conn.send(h11.Data(data=b"two"))
                + conn.send(h11.EndOfMessage()))
            await _unread_while(protocol, writer, request, 0.5)
            second = await asyncio.wait_for(_read_answer(conn, reader), 5)
            writer.close()
            return [first, second]

    outcomes = asyncio.run(main())
    assert [(o.status, o.body, o.error) for o in outcomes] == [(200, b"one", None),
                                                               (200, b"two", None)]


def test_headers_still_short_once_read_after_the_deadline_get_408_at_once():
    """A dribbler gains nothing from a busy loop: the bytes it had waiting are read, they still
    do not complete its headers, and it is answered at once, not given a fresh deadline (nor
    reset, as a close with its bytes unread would do, losing the answer)."""
    async def main() -> tuple[Outcome, float]:
        async with _echo_server(client_timeout=0.4) as (port, connections):
            reader, writer, protocol = await _connect(port, connections)
            conn = h11.Connection(h11.CLIENT)
            conn.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
            writer.write(b"POST /echo HTTP/1.1\r\n")
            await asyncio.sleep(0.1)
            await _unread_while(protocol, writer, b"Host: x\r\n", 0.4)  # the deadline passes
            resumed = time.monotonic()
            outcome = await asyncio.wait_for(_read_answer(conn, reader), 5)
            seconds = time.monotonic() - resumed
            writer.close()
            return outcome, seconds

    outcome, seconds = asyncio.run(main())
    assert outcome.status == 408 and json.loads(outcome.body)["error"]["code"] == 408
    assert seconds < 0.15  # a fresh deadline would answer 0.3 s after the read
