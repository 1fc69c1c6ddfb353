"""The request lifecycle as a transition table (docs/architecture.md).

Prefill versus decode is not a state: a RUNNING request whose computed tokens lag its prompt
is prefilling. The enum's order encodes "finished": every state from FINISHED on is terminal.
"""

from __future__ import annotations

from enum import Enum, IntEnum

from actorlm.fsm.machine import Transition, TransitionTable


class RequestState(IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED = 3


class RequestEvent(Enum):
    SCHEDULE = "schedule"
    PREEMPT = "preempt"
    FINISH = "finish"
    ABORT = "abort"
    FAIL = "fail"


class FinishReason(str, Enum):
    STOP = "stop"  # EOS, stop token, stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"
    ERROR = "error"


_W, _R, _P, _F = RequestState
_ROWS = [
    Transition(_W, RequestEvent.SCHEDULE, _R),
    Transition(_R, RequestEvent.PREEMPT, _P),
    Transition(_P, RequestEvent.SCHEDULE, _R),
    Transition(_R, RequestEvent.FINISH, _F),
    # a stop string is found by the frontend a step after its token: the request may have
    # been preempted in between, and it is still a normal finish
    Transition(_P, RequestEvent.FINISH, _F),
    *(Transition(s, e, _F) for s in (_W, _R, _P) for e in (RequestEvent.ABORT, RequestEvent.FAIL)),
]

REQUEST_LIFECYCLE = TransitionTable(RequestState, RequestEvent, _ROWS, initial=_W, terminal=[_F])
