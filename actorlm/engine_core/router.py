"""ReplicaRouter: the scheduler, as the FrontendActor sees it, over one or more engine cores.

With ``--data-parallel-size N`` the engine runs N engine cores, each with its own workers and
KV pool; the router gives each new request to the least loaded (``balancer.LeastLoaded``),
sends an abort or a stop to the core that runs the request, and stands in for the frontend
to each core's client: a step's outputs pass through it (its finished requests leave the
balancer) on their way to the FrontendActor, and a restarted core asks it, not the frontend,
to resume its requests: it resumes that core's own, and the others never pause.
"""

from __future__ import annotations

import threading

import pykka

from actorlm.engine_core.balancer import LeastLoaded
from actorlm.engine_core.client import EngineCoreClient
from actorlm.messages import (AbortRequests, AddRequest, EngineOutputs, ResumeRequests,
                              StopRequests, engine_request_ids)


class ReplicaRouter:
    def __init__(self, clients: list[EngineCoreClient]):
        self.clients = clients
        self.balancer = LeastLoaded(len(clients))
        self._lock = threading.Lock()  # the frontend's thread and every client's reader
        self._frontend = None

    def attach(self, frontend, on_dead) -> None:
        self._frontend = frontend
        for index, client in enumerate(self.clients):
            client.attach(_ReplicaSide(self, index), on_dead)

    # --- the FrontendActor's side --------------------------------------------------------------

    def tell(self, message) -> None:
        if isinstance(message, AddRequest):
            engine_ids = engine_request_ids(message.request_id, message.sampling_params.n)
            with self._lock:
                for index, client in enumerate(self.clients):
                    if client.last_heartbeat is not None:
                        self.balancer.report(index, client.last_heartbeat.num_waiting)
                replica = self.balancer.assign(engine_ids)
            self.clients[replica].tell(message)
        elif isinstance(message, (AbortRequests, StopRequests)):
            with self._lock:
                groups = self.balancer.by_owner(message.request_ids)
            for replica, engine_ids in groups.items():
                self.clients[replica].tell(_only(message, engine_ids))
        else:
            raise TypeError(f"an engine core does not take {type(message).__name__}")

    # --- each core's side ----------------------------------------------------------------------

    def outputs(self, outputs: EngineOutputs) -> None:
        with self._lock:
            for delta in outputs.deltas:
                if delta.finish_reason is not None:
                    self.balancer.finished(delta.request_id)
        try:
            self._frontend.tell(outputs)
        except pykka.ActorDeadError:
            pass  # the frontend has stopped first: the engine is shutting down

    def resume(self, replica: int):
        """Replica ``replica`` was restarted: the FrontendActor gives back its live requests;
        those it finished instead (stopped, aborted, failed) leave the balancer."""
        with self._lock:
            owned = self.balancer.owned_by(replica)
        resumed = self._frontend.ask(ResumeRequests(sorted(owned)))
        with self._lock:
            for engine_id in owned - {add.request_id for add in resumed.requests}:
                self.balancer.finished(engine_id)
        return resumed


class _ReplicaSide:
    """The frontend, as replica ``index``'s client sees it."""

    def __init__(self, router: ReplicaRouter, index: int):
        self.router, self.index = router, index

    def tell(self, outputs: EngineOutputs) -> None:
        self.router.outputs(outputs)

    def ask(self, message: ResumeRequests):
        return self.router.resume(self.index)


def _only(message: AbortRequests | StopRequests, engine_ids: list[str]):
    if isinstance(message, AbortRequests):
        return AbortRequests(engine_ids)
    reasons = dict(zip(message.request_ids, message.stop_reasons))
    return StopRequests(engine_ids, [reasons[eid] for eid in engine_ids])
