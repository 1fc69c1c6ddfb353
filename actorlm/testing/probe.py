"""TestProbe: a real actor that stands in for any peer and records what it is sent.

Pass ``probe.ref`` (a genuine ``pykka.ActorRef``) wherever an actor expects a peer — a
scheduler's allocator, an allocator's scheduler — then assert on what arrived::

    probe = TestProbe("allocator")
    scheduler.tell(Connect(frontend.ref, probe.ref, executor.ref))
    scheduler.tell(add_request)
    allocate = probe.expect_message(AllocateSlots)

A message is recorded in the *sender's* thread, at the moment ``tell`` or ``ask`` puts it in
the probe's inbox. So once the sender has handled the message that made it send (for example
after a blocking ``ask`` to the sender returns), the probe already holds it:
``expect_no_message(0)`` is then an exact check, not a guess about timing.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from typing import Any, Callable

import pykka
from pykka import messages as pykka_messages

Matcher = type | tuple | Callable[[Any], bool] | None


def _matches(matcher: Matcher, message: Any) -> bool:
    if matcher is None:
        return True
    if isinstance(matcher, (type, tuple)):
        return isinstance(message, matcher)
    return bool(matcher(message))


def _describe(matcher: Matcher) -> str:
    if matcher is None:
        return "any message"
    if isinstance(matcher, type):
        return matcher.__name__
    if isinstance(matcher, tuple):
        return " or ".join(m.__name__ for m in matcher)
    return getattr(matcher, "__name__", repr(matcher))


class _RecordingInbox(queue.Queue):
    """The probe actor's inbox: user messages are recorded on ``put`` (in the sender's thread);
    only pykka's own control messages (stop) reach the actor's loop."""

    def __init__(self, probe: TestProbe):
        super().__init__()
        self._probe = probe

    def put(self, envelope, block=True, timeout=None):
        if type(envelope.message).__module__ == pykka_messages.__name__:
            return super().put(envelope, block, timeout)
        self._probe._record(envelope.message, envelope.reply_to)


class _ProbeActor(pykka.ThreadingActor):
    def __init__(self, probe: TestProbe):
        self._probe = probe  # read by _create_actor_inbox, which super().__init__ calls
        super().__init__()

    def _create_actor_inbox(self):  # pykka's hook for actor types with their own inbox
        return _RecordingInbox(self._probe)

    def on_receive(self, message):  # pragma: no cover — user messages never reach the loop
        raise AssertionError(f"probe loop received {message!r}")


class TestProbe:
    """A stand-in actor. ``ref`` is a real ``pykka.ActorRef``; every message sent to it is kept
    in ``messages`` (all, in arrival order) and queued for the ``expect_*`` methods."""

    __test__ = False  # not a pytest test class

    def __init__(self, name: str = "probe", *, default_timeout: float = 5.0):
        self.name = name
        self.default_timeout = default_timeout
        self.messages: list[Any] = []  # everything ever received, in order
        self._unread: deque[Any] = deque()
        self._asks: deque[tuple[Any, pykka.Future]] = deque()  # unanswered asks, oldest first
        self._cond = threading.Condition()
        self.ref: pykka.ActorRef = _ProbeActor.start(self)

    # --- receiving ----------------------------------------------------------------------------

    def _record(self, message: Any, reply_to: pykka.Future | None) -> None:
        with self._cond:
            self.messages.append(message)
            self._unread.append(message)
            if reply_to is not None:
                self._asks.append((message, reply_to))
            self._cond.notify_all()

    def expect_message(self, matcher: Matcher = None, timeout: float | None = None) -> Any:
        """Take the next unread message, waiting up to ``timeout`` seconds for one to arrive,
        and check it against ``matcher``: a type (or tuple of types), a predicate, or None for
        any message. Returns the message; raises AssertionError on a mismatch or a timeout."""
        timeout = self.default_timeout if timeout is None else timeout
        with self._cond:
            if not self._cond.wait_for(lambda: self._unread, timeout):
                raise AssertionError(f"{self.name}: expected {_describe(matcher)} within "
                                     f"{timeout} s, got nothing")
            message = self._unread.popleft()
        if not _matches(matcher, message):
            raise AssertionError(f"{self.name}: expected {_describe(matcher)}, got {message!r}")
        return message

    def expect_no_message(self, duration: float = 0.1) -> None:
        """Assert that nothing unread is waiting and nothing arrives within ``duration`` seconds.
        ``duration=0`` checks only what has already arrived (exact after a barrier ``ask``)."""
        with self._cond:
            if self._cond.wait_for(lambda: self._unread, duration):
                raise AssertionError(f"{self.name}: expected no message, got {self._unread[0]!r}")

    def fish_for_message(self, matcher: Matcher, timeout: float | None = None) -> Any:
        """Skip unread messages until one matches ``matcher``; returns it."""
        timeout = self.default_timeout if timeout is None else timeout
        with self._cond:
            while True:
                while self._unread:
                    message = self._unread.popleft()
                    if _matches(matcher, message):
                        return message
                if not self._cond.wait_for(lambda: self._unread, timeout):
                    raise AssertionError(f"{self.name}: no {_describe(matcher)} within {timeout} s")

    def receive_all(self) -> list[Any]:
        """Take every unread message without waiting."""
        with self._cond:
            unread, self._unread = list(self._unread), deque()
            return unread

    def received(self, matcher: Matcher = None) -> list[Any]:
        """Every message received so far (read or not) that matches ``matcher``."""
        with self._cond:
            return [m for m in self.messages if _matches(matcher, m)]

    # --- answering ----------------------------------------------------------------------------

    def reply(self, value: Any = None) -> Any:
        """Answer the most recent unanswered ``ask`` made to the probe with ``value`` (an
        exception instance makes the asker's ``ask`` raise it). Returns the asked message."""
        with self._cond:
            if not self._asks:
                raise AssertionError(f"{self.name}: reply() but nobody asked")
            message, future = self._asks.pop()
        if isinstance(value, BaseException):
            future.set_exception((type(value), value, value.__traceback__))
        else:
            future.set(value)
        return message

    @property
    def num_pending_asks(self) -> int:
        with self._cond:
            return len(self._asks)

    # --- lifecycle ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop the probe actor; unanswered asks fail with ActorDeadError."""
        if self.ref.is_alive():
            self.ref.stop(block=True)
        with self._cond:
            asks, self._asks = list(self._asks), deque()
        for message, future in asks:
            error = pykka.ActorDeadError(f"{self.name} stopped before answering {message!r}")
            future.set_exception((type(error), error, None))

    def __enter__(self) -> TestProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (f"TestProbe({self.name!r}, {len(self.messages)} received, "
                f"{len(self._unread)} unread)")
