from actorlm.fsm.machine import Machine, Transition, TransitionError, TransitionTable
from actorlm.fsm.request import REQUEST_LIFECYCLE, FinishReason, RequestEvent, RequestState

__all__ = ["Machine", "Transition", "TransitionError", "TransitionTable", "REQUEST_LIFECYCLE",
           "FinishReason", "RequestEvent", "RequestState"]
