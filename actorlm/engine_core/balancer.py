"""LeastLoaded: which data-parallel replica takes a new request, and which one runs each.

vLLM's rule: the replica with the lowest ``4 * waiting + running`` takes it (a waiting request
weighs four running ones: it will hold a step's prefill). Here ``waiting + running`` is the
replica's live sequences, counted exactly on this side (a request's children added, each
finished one removed), and ``waiting`` is the replica's last report (its heartbeat, twice a
second), so the score is ``live + 3 * waiting``; ties go to the lower index. Every engine id
is remembered with its replica until it finishes, so an abort or a stop reaches the one that
runs it, and a replica that dies resumes exactly its own.
"""

from __future__ import annotations

from collections import defaultdict


class LeastLoaded:
    def __init__(self, num_replicas: int):
        self.num_replicas = num_replicas
        self._owner: dict[str, int] = {}  # live engine id -> its replica
        self._live = [0] * num_replicas
        self._waiting = [0] * num_replicas  # as last reported
        self.num_assigned = [0] * num_replicas  # requests given to each, since start

    def assign(self, engine_ids: list[str]) -> int:
        """The replica for a new request's sequences (its ``n`` children go together: they
        share the prompt's KV)."""
        replica = min(range(self.num_replicas),
                      key=lambda i: (self._live[i] + 3 * self._waiting[i], i))
        for engine_id in engine_ids:
            self._owner[engine_id] = replica
        self._live[replica] += len(engine_ids)
        self.num_assigned[replica] += 1
        return replica

    def report(self, replica: int, num_waiting: int) -> None:
        self._waiting[replica] = num_waiting

    def finished(self, engine_id: str) -> None:
        replica = self._owner.pop(engine_id, None)
        if replica is not None:
            self._live[replica] -= 1

    def owner(self, engine_id: str) -> int | None:
        return self._owner.get(engine_id)

    def by_owner(self, engine_ids: list[str]) -> dict[int, list[str]]:
        """``engine_ids`` grouped by the replica that runs them (unknown ones dropped: they
        have finished, and the engine would ignore them)."""
        groups: dict[int, list[str]] = defaultdict(list)
        for engine_id in engine_ids:
            if (replica := self._owner.get(engine_id)) is not None:
                groups[replica].append(engine_id)
        return groups

    def owned_by(self, replica: int) -> set[str]:
        return {eid for eid, owner in self._owner.items() if owner == replica}

    def live(self, replica: int) -> int:
        return self._live[replica]
