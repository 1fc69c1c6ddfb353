"""What every actor shares, the engine's (``actors/``) and the in-process workers
(``executors/worker_actor.py``) alike: daemon threads, contained crashes, and a death that is
reported."""

from __future__ import annotations

import logging
from typing import Callable

import pykka

log = logging.getLogger(__name__)


class ActorCrashed(Exception):
    """A ``BaseException`` (``SystemExit``, say) escaped an actor's handler. pykka would stop
    every actor in the process for it, other engines' included; this actor fails alone."""


class EngineActor(pykka.ThreadingActor):
    """An engine actor. Its thread is a daemon, so a script that never calls ``shutdown()``
    still exits (``LLM`` and ``AsyncLLM`` stop their actors from a finalizer at exit). When it
    dies, by an exception in a handler or by any ``stop()``, it calls ``on_death(reason)`` on
    its own thread: its supervisor's hook, which knows whether the stop was planned."""

    use_daemon_thread = True

    def __init__(self, on_death: Callable[[str], None] | None = None):
        super().__init__()
        self._on_death = on_death

    def _handle_receive(self, message):
        try:
            return super()._handle_receive(message)
        except Exception:
            raise
        except BaseException as exc:  # noqa: BLE001 — see ActorCrashed
            raise ActorCrashed(f"{type(exc).__name__}: {exc}") from exc

    def on_failure(self, exception_type, exception_value, traceback) -> None:
        self._died(f"failed: {exception_type.__name__}: {exception_value}")

    def on_stop(self) -> None:
        self._died("stopped")

    def _died(self, reason: str) -> None:
        if self._on_death is not None:
            self._on_death(reason)


def tell(ref: pykka.ActorRef, message) -> None:
    """Send without waiting. A peer that has stopped has already reported its death to its
    supervisor (which fails what it held), so the message is dropped rather than killing the
    sender too."""
    try:
        ref.tell(message)
    except pykka.ActorDeadError:
        log.debug("dropped %s: %s has stopped", type(message).__name__, ref)
