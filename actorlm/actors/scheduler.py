"""SchedulerActor: drives the engine loop. A thin shell: the loop is ``core/step_loop.py``
(``StepLoop``) and the policy ``core/scheduler.py``; the actor only wires the loop's
``send(peer, message)`` to its peers' refs and answers ``GetStats``."""

from __future__ import annotations

import pykka

from actorlm.core.scheduler import Scheduler
from actorlm.core.step_loop import StepLoop
from actorlm.engine_actor import EngineActor, tell
from actorlm.messages import Connect, GetStats


class SchedulerActor(EngineActor):
    def __init__(self, scheduler: Scheduler, trace=None, on_death=None, grammars=None):
        super().__init__(on_death)
        self.loop = StepLoop(scheduler, self._send, trace, grammars)
        self._peers: dict = {}

    def on_start(self):
        if self.loop.grammars is not None:  # compiled grammars come back as messages
            self.loop.grammars.notify = self._grammar_compiled

    def on_stop(self):
        if self.loop.grammars is not None:
            self.loop.grammars.shutdown()
        super().on_stop()

    def on_receive(self, message):
        if isinstance(message, GetStats):
            return self.loop.stats()
        if isinstance(message, Connect):
            self._peers = {"frontend": message.frontend, "allocator": message.allocator,
                           "executor": message.executor}
            return None
        self.loop.handle(message)

    def _grammar_compiled(self, message) -> None:
        try:
            self.actor_ref.tell(message)
        except pykka.ActorDeadError:
            pass  # the engine stopped while it compiled: nobody waits for it

    def _send(self, peer: str, message) -> None:
        tell(self._peers[peer], message)
