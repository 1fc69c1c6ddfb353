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
            try:
                result: StepResult = self.runner.execute(message)
            except Exception as exc:  # noqa: BLE001 — a fault fails this step's requests only
                result = StepResult(message.step_id, [], [], f"{type(exc).__name__}: {exc}",
                                    message.request_ids)
            if result.error:
                log.error("worker %d: step %d failed for requests %s: %s", self.rank,
                          result.step_id, result.failed_request_ids, result.error)
            tell(self.executor, WorkerResult(self.rank, result))
        else:
            raise TypeError(f"WorkerActor cannot handle {type(message).__name__}")
