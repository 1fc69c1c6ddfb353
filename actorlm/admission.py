"""Whether a new request may join the waiting queue: ``max_num_waiting``, the server's bound
on the requests waiting for a seat (``max_num_seqs`` in every replica); past it a request is
refused at once (503, ``Retry-After``) rather than queued for longer than a client waits."""

from __future__ import annotations

from actorlm.messages import SchedulerStats


class EngineOverloadedError(RuntimeError):
    """The waiting queue is at ``max_num_waiting``; the caller should retry later."""


def check_waiting_room(stats: SchedulerStats, seats: int, max_num_waiting: int) -> None:
    """Raise EngineOverloadedError if ``max_num_waiting`` requests already wait. One that has
    arrived but is not yet scheduled does not count while a seat is free for it: the queue's
    length must not depend on when the step loop runs."""
    free_seats = max(0, seats - stats.num_running)
    num_waiting = max(0, stats.num_waiting - free_seats)
    if num_waiting >= max_num_waiting:
        raise EngineOverloadedError(f"the server is overloaded: {num_waiting} requests are "
                                    f"waiting (--max-num-waiting {max_num_waiting}); retry later")
