"""uvicorn's HTTP/1.1 connection, with deadlines for slow clients and answers for half-closes.

uvicorn times out only idle keep-alive connections: a client that sends its headers (or its
body) a byte at a time holds a connection forever, and hundreds of them hold the server. Here
a request's headers must arrive within ``client_timeout`` of their first byte (of the
connection, for the first request), its body may not pause longer than that, and a body still
arriving after the answer (a 413 before the body was read) gets that long to finish.

A deadline measures the client's silence, and a client whose bytes lie in the socket unread
is not silent. A busy loop runs a due timer late (by a tenth of a second and more under a
burst), and bytes that arrived meanwhile are read only after it; so a deadline, and uvicorn's
keep-alive timeout, look at the socket before they act. Bytes waiting there end a body's
pause, or the wait for a request's first byte (its headers then get their full time); headers
already under way are judged once those bytes are read, so a client that sends them a byte at
a time is still cut off.

uvicorn also treats the end of the client's byte stream as a hang-up, so a client that
half-closes after its request (``shutdown(SHUT_WR)``, as ``nc -N`` does) gets no answer. TCP
cannot tell the two apart until the client receives something: here the server then sends an
interim ``100 Continue`` (every HTTP/1.1 client parses those) and watches the socket. A client
that hung up answers it with a reset, and its request is aborted as before; a half-closed one
takes it and later gets its answer. Where the socket's TCP state cannot be read (not Linux),
the end of the stream is a hang-up, as in uvicorn.
"""

from __future__ import annotations

import asyncio
import socket
import struct

import h11
import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from actorlm.api import protocol as p

try:
    from fcntl import ioctl
    from termios import FIONREAD
except ImportError:  # no ioctl (Windows): unread bytes cannot be seen, as in uvicorn
    ioctl = FIONREAD = None

_TCP_CLOSE = 7  # tcpi_state once the peer's reset has arrived (linux/tcp_states.h)
_PROBE_INTERVAL_S = 0.05


def _num_unread_bytes(transport) -> int:
    """The bytes the peer has sent that lie in the socket, not yet read by the loop."""
    sock = transport.get_extra_info("socket")
    if ioctl is None or sock is None:
        return 0
    try:
        return struct.unpack("i", ioctl(sock.fileno(), FIONREAD, b"\0" * 4))[0]
    except (OSError, ValueError):  # closed meanwhile (its descriptor is then -1)
        return 0


class GuardedH11Protocol(H11Protocol):
    def __init__(self, *args, client_timeout: float, **kwargs):
        super().__init__(*args, **kwargs)
        self.client_timeout = client_timeout
        self._deadline: asyncio.TimerHandle | None = None  # for the request being received
        self._linger: asyncio.TimerHandle | None = None  # for a body nobody will read
        self._probe: asyncio.Task | None = None
        # the headers' time ran out while more of them lay unread: judged once they are read
        self._headers_overdue = False

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc) -> None:
        for timer in (self._deadline, self._linger):
            if timer is not None:
                timer.cancel()
        if self._probe is not None:
            self._probe.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        state = self.conn.their_state
        if self.transport.is_closing() or state not in (h11.IDLE, h11.SEND_BODY):
            self._disarm()  # the request is in: the app has it
        elif state is h11.SEND_BODY:  # every arrival restarts the pause allowed
            self._disarm()
            self._arm()
        elif self._headers_overdue:  # what lay unread did not complete them
            self._send_error(408, self._late_message())
        elif self._deadline is None:  # the first bytes of the next request's headers
            self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self._linger = self.loop.call_later(self.client_timeout, self._close)

    def eof_received(self) -> bool | None:
        self._disarm()
        state, cycle = self.conn.their_state, self.cycle
        buffered = bool(self.conn.trailing_data[0])
        if state is h11.IDLE and not buffered:
            return None  # the ordinary end of a keep-alive connection
        if state is not h11.DONE or cycle is None or cycle.response_complete:
            if cycle is None or not cycle.response_started:
                self._send_error(400, "the connection ended before the request was complete")
            return None
        if not hasattr(socket, "TCP_INFO"):
            return None  # cannot tell a half-close from a hang-up: uvicorn's hang-up
        if not cycle.response_started:
            self.transport.write(self.conn.send(
                h11.InformationalResponse(status_code=100, headers=[], reason="Continue")))
        self._probe = self.loop.create_task(self._watch_for_reset())
        return True  # keep the sending half open for the answer

    def timeout_keep_alive_handler(self) -> None:
        if not self.transport.is_closing() and _num_unread_bytes(self.transport):
            # the next request is here; the loop is behind
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler)
            return
        super().timeout_keep_alive_handler()

    def send_400_response(self, msg: str) -> None:  # a request h11 could not parse
        self._send_error(400, msg)

    # --- internals ---------------------------------------------------------------------------

    def _arm(self) -> None:
        self._deadline = self.loop.call_later(self.client_timeout, self._on_deadline)

    def _disarm(self) -> None:
        self._headers_overdue = False
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_deadline(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the app is not reading: the client is not the slow one
            self._arm()
            return
        state, buffered = self.conn.their_state, bool(self.conn.trailing_data[0])
        if state not in (h11.IDLE, h11.SEND_BODY):
            return  # the request is in
        if _num_unread_bytes(self.transport):  # the client spoke; the loop has not read it yet
            self._arm()  # a safeguard: reading them rearms, disarms or judges
            self._headers_overdue = state is h11.IDLE and buffered
        elif state is h11.IDLE and not buffered:
            self._close()  # connected and said nothing
        else:
            self._send_error(408, self._late_message())

    def _late_message(self) -> str:
        return f"the request did not arrive within {self.client_timeout:g} s (--client-timeout)"

    def _send_error(self, status: int, message: str) -> None:
        """Answer in OpenAI's shape and close, unless the app has started its own answer."""
        cycle = self.cycle
        if cycle is not None:
            cycle.disconnected = True  # the app's reads now end; its answer goes nowhere
            cycle.message_event.set()
        if (cycle is None or not cycle.response_started) and self.conn.our_state in (
                h11.IDLE, h11.SEND_RESPONSE):
            body = msgspec.json.encode(p.ApiError(status, message).response())
            headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                       (b"content-length", str(len(body)).encode())]
            try:
                self.transport.write(self.conn.send(h11.Response(status_code=status,
                                                                 headers=headers)))
                self.transport.write(self.conn.send(h11.Data(data=body)))
                self.transport.write(self.conn.send(h11.EndOfMessage()))
            except h11.LocalProtocolError:
                pass
        self._close()

    def _close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()

    async def _watch_for_reset(self) -> None:
        sock = self.transport.get_extra_info("socket")
        cycle = self.cycle
        while not cycle.response_complete and not self.transport.is_closing():
            await asyncio.sleep(_PROBE_INTERVAL_S)
            try:
                reset = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == _TCP_CLOSE
            except OSError:
                reset = True
            if reset:  # a hang-up after all
                self.transport.close()
                return
