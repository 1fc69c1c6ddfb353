"""WorkerActor: one device. Owns the weights, the KV tensors and the persistent batch."""

from __future__ import annotations

import logging

import pykka

from actorlm.actors.base import tell
from actorlm.messages import ScheduleStep, StepResult, WorkerResult

log = logging.getLogger(__name__)


class WorkerActor(pykka.ThreadingActor):
    """Runs each ``ScheduleStep`` on its model runner and tells the executor the result."""

    def __init__(self, rank: int, runner, executor: pykka.ActorRef):
        super().__init__()
        self.rank, self.runner, self.executor = rank, runner, executor

    def on_receive(self, message):
        if isinstance(message, ScheduleStep):
            result: StepResult = self.runner.execute(message)
            if result.error:
                log.error("worker %d: step %d failed for requests %s: %s", self.rank,
                          result.step_id, result.failed_request_ids, result.error)
            tell(self.executor, WorkerResult(self.rank, result))
        else:
            raise TypeError(f"WorkerActor cannot handle {type(message).__name__}")
