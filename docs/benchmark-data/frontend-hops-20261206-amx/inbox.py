"""SocketInbox: an actor's inbox that also reads the engine cores' output sockets.

With a reader thread per core, each step's outputs crossed three threads in the frontend's
process (zmq's I/O thread, the reader, the FrontendActor) before the event loop, and on a
small machine the wake-ups cost more than the work they delivered. With this inbox the
FrontendActor's own thread waits on its messages and on the cores' sockets at once: a
step's frame is read, decoded and delivered where the streams live, one hop fewer. The
thread that owns the messages owns the sockets too: a socket is handed over with
``watch``, itself a message, and from then on no other thread touches it.
"""

from __future__ import annotations

import collections
import socket
from typing import Callable, NamedTuple

import zmq

from actorlm.actors.frontend import FrontendActor


class SocketInbox:
    """pykka's inbox (``put``, ``get``, ``empty``), also fed by ZMQ sockets: ``take(frame)``
    turns each frame read from a watched socket into a message for the actor, or None. What
    ``take`` raises reaches the actor as a ``FrameFailed``: the actor fails (and its
    supervisor hears of it) rather than its thread dying silently inside pykka's loop."""

    def __init__(self):
        self._envelopes: collections.deque = collections.deque()  # appends are thread-safe
        self._wake_read, self._wake_write = socket.socketpair()
        self._wake_read.setblocking(False)
        self._wake_write.setblocking(False)
        self._poller = zmq.Poller()
        self._poller.register(self._wake_read, zmq.POLLIN)  # (poll names it by its fd)
        self._takers: dict[zmq.Socket, Callable[[bytes], object | None]] = {}
        self._sleeping = False  # the owner waits in poll: a put must wake it

    def watch(self, source: zmq.Socket, take: Callable[[bytes], object | None]) -> None:
        """From now on the actor's thread reads ``source`` (any thread may call this)."""
        self.put(_Envelope(_Watch(source, take)))

    def put(self, envelope) -> None:
        self._envelopes.append(envelope)
        if self._sleeping:  # (set before the owner's last look at the deque: no lost wake-up)
            try:
                self._wake_write.send(b"\0")
            except BlockingIOError:  # full of wake-ups already
                pass

    def empty(self) -> bool:
        return not self._envelopes

    def get(self):
        while True:
            while self._envelopes:
                envelope = self._envelopes.popleft()
                if not isinstance(envelope.message, _Watch):
                    return envelope
                self._takers[envelope.message.source] = envelope.message.take
                self._poller.register(envelope.message.source, zmq.POLLIN)
            self._sleeping = True
            try:
                ready = [] if self._envelopes else self._poller.poll()
            finally:
                self._sleeping = False
            for source, _ in ready:
                if source == self._wake_read.fileno():
                    _drain(self._wake_read)
                    continue
                try:
                    frame = source.recv(zmq.NOBLOCK)
                except zmq.Again:  # (a wake-up with nothing to read)
                    continue
                try:
                    message = self._takers[source](frame)
                except Exception as exc:  # noqa: BLE001 — handed to the actor, see above
                    message = FrameFailed(exc)
                if message is not None:
                    return _Envelope(message)


class SocketFedFrontend(FrontendActor):
    """The FrontendActor of an engine whose cores run in processes of their own: its thread
    reads their outputs itself (``SocketInbox``)."""

    _create_actor_inbox = staticmethod(SocketInbox)

    def on_receive(self, message):
        if isinstance(message, FrameFailed):
            raise RuntimeError(f"an engine core's output could not be read: "
                               f"{type(message.error).__name__}: {message.error}") \
                from message.error
        return super().on_receive(message)


class FrameFailed(NamedTuple):
    error: Exception


class _Envelope(NamedTuple):
    """What pykka's actor loop reads of an envelope."""

    message: object
    reply_to: None = None


class _Watch(NamedTuple):
    source: zmq.Socket
    take: Callable[[bytes], object | None]


def _drain(wake: socket.socket) -> None:
    try:
        while wake.recv(4096):
            pass
    except BlockingIOError:
        pass
