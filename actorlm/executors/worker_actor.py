"""WorkerActor: one rank as a thread in the engine process (``threads.ThreadWorkerGroup``).
Owns the weights, the KV tensors and the runner's per-request cached state (each running
request's token ids and block ids, so that a step carries only what changed)."""

from __future__ import annotations

import logging

import pykka

from actorlm.engine_actor import EngineActor, tell
from actorlm.messages import GrammarBitmask, ScheduleStep, WorkerFailed, WorkerResult

log = logging.getLogger(__name__)


class WorkerActor(EngineActor):
    """Runs each ``ScheduleStep`` on its model runner and tells the executor the result.

    A runner that raises leaves its cached request state and KV cache half-updated, so the worker
    does not go on: it reports ``WorkerFailed`` and the executor replaces it. Its death (an
    escaped exception, a stop) is reported the same way, by the death hook.
    """

    def __init__(self, rank: int, generation: int, runner, executor: pykka.ActorRef):
        super().__init__(on_death=self._report_death)
        self.rank, self.generation, self.runner, self.executor = rank, generation, runner, executor
        self._reported = False

    def on_receive(self, message):
        if isinstance(message, ScheduleStep):
            run = self.runner.execute
        elif isinstance(message, GrammarBitmask):
            run = self.runner.sample_tokens  # the step's forward ran; now it samples
        else:
            raise TypeError(f"WorkerActor cannot handle {type(message).__name__}")
        if self._reported:
            return  # failed already: the executor is replacing this worker
        try:
            result = run(message)
        except Exception as exc:  # noqa: BLE001 — the executor recomputes the step elsewhere
            log.error("worker %d: step %d raised; the worker will be replaced", self.rank,
                      message.step_id, exc_info=True)
            self._report(f"{type(exc).__name__}: {exc}")
            return
        if result is None:
            return  # it waits for the step's GrammarBitmask
        if result.error:
            log.error("worker %d: step %d failed requests %s: %s", self.rank, result.step_id,
                      result.failed_request_ids, result.error)
        tell(self.executor, WorkerResult(self.rank, result))

    def _report_death(self, reason: str) -> None:
        self._report(f"its thread {reason}")

    def _report(self, error: str) -> None:
        if not self._reported:
            self._reported = True
            self.runner = None  # the replacement may need its memory (a GPU's KV cache)
            tell(self.executor, WorkerFailed(self.rank, self.generation, error))
