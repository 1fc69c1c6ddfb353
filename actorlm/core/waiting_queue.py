"""The order in which the scheduler serves requests: vLLM's two scheduling policies
(``--scheduling-policy``).

- ``fcfs``: arrival order. A preempted request goes back to the front of the waiting queue,
  and the running request admitted last is the first preempted.
- ``priority``: by the request's ``priority``, smaller first (vLLM's sense), then by arrival.
  Both queues keep that order: a preempted request goes back to its place in it (ahead of its
  equals), and the running request last in it (the lowest priority, the newest of its rank) is
  the one preempted when blocks run short. As in vLLM, a waiting request never preempts a
  running one: it waits for blocks as it would under fcfs.

A sorted deque rather than vLLM's heap, because the scheduler walks the whole waiting queue in
order every step to fill the token budget, which a heap would have to sort each time.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right, insort
from collections import deque
from typing import Iterator

from actorlm.config import SCHEDULING_POLICIES
from actorlm.core.request import Request


def priority_order(request: Request) -> tuple[int, float]:
    return request.priority, request.arrival_time


class WaitingQueue:
    """WAITING and PREEMPTED requests, front first."""

    def __init__(self, policy: str = "fcfs"):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {policy!r}; known: "
                             f"{', '.join(SCHEDULING_POLICIES)}")
        self.by_priority = policy == "priority"
        self._requests: deque[Request] = deque()

    def add(self, request: Request) -> None:
        """A new arrival: behind every request it does not outrank."""
        self._insert(request, ahead_of_equals=False)

    def put_back(self, request: Request) -> None:
        """A preempted request, or a child of ``n`` whose prompt is now cached: ahead of the
        requests it does not yield to (all of them, under fcfs)."""
        self._insert(request, ahead_of_equals=True)

    def _insert(self, request: Request, ahead_of_equals: bool) -> None:
        if not self.by_priority:  # every request is the equal of every other
            if ahead_of_equals:
                self._requests.appendleft(request)
            else:
                self._requests.append(request)
            return
        find = bisect_left if ahead_of_equals else bisect_right
        self._requests.insert(find(self._requests, priority_order(request), key=priority_order),
                              request)

    def remove(self, request: Request) -> None:
        if self._requests[0] is request:  # the usual case: admitted from the front
            self._requests.popleft()
        else:
            self._requests.remove(request)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request: Request) -> bool:
        return request in self._requests


def start_running(running: list[Request], request: Request, by_priority: bool) -> None:
    """Add an admitted request to ``running``, kept in the order its requests are served and,
    from the end, preempted: admission order, or priority order."""
    if by_priority:
        insort(running, request, key=priority_order)
    else:
        running.append(request)
