"""What every actor shares."""

from __future__ import annotations

import logging

import pykka

log = logging.getLogger(__name__)


def tell(ref: pykka.ActorRef, message) -> None:
    """Send without waiting. A peer that has stopped means the engine is shutting down:
    the message has nobody left to serve, so it is dropped rather than killing the sender."""
    try:
        ref.tell(message)
    except pykka.ActorDeadError:
        log.debug("dropped %s: %s has stopped", type(message).__name__, ref)
