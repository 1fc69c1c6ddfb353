from enum import Enum

import pytest

from actorlm.fsm import (REQUEST_LIFECYCLE, Machine, RequestEvent, RequestState, Transition,
                         TransitionError, TransitionTable)

W, R, P, F = RequestState
E = RequestEvent


def test_request_lifecycle_table_is_exactly_the_design():
    moves = {(t.source, t.event): t.target for t in REQUEST_LIFECYCLE.transitions}
    expected = {(W, E.SCHEDULE): R, (R, E.PREEMPT): P, (P, E.SCHEDULE): R, (R, E.FINISH): F,
                (P, E.FINISH): F}
    for state in (W, R, P):
        expected[(state, E.ABORT)] = F
        expected[(state, E.FAIL)] = F
    assert moves == expected


@pytest.mark.parametrize("path", [
    [E.SCHEDULE, E.FINISH],
    [E.SCHEDULE, E.PREEMPT, E.SCHEDULE, E.PREEMPT, E.SCHEDULE, E.FINISH],
    [E.ABORT], [E.SCHEDULE, E.PREEMPT, E.FAIL],
])
def test_legal_paths_reach_finished_and_notify_each_move(path):
    seen = []
    machine = Machine(REQUEST_LIFECYCLE, "r", [lambda m, t: seen.append((t.source, t.target))])
    for event in path:
        machine.fire(event)
    assert machine.state is F and machine.is_terminal
    assert len(seen) == len(path) and seen[-1][1] is F


@pytest.mark.parametrize("prefix,illegal", [
    ([], E.PREEMPT), ([], E.FINISH),
    ([E.SCHEDULE], E.SCHEDULE),
    ([E.SCHEDULE, E.PREEMPT], E.PREEMPT),
    ([E.SCHEDULE, E.FINISH], E.ABORT), ([E.ABORT], E.SCHEDULE), ([E.FAIL], E.FAIL),
])
def test_illegal_events_raise_and_change_nothing(prefix, illegal):
    seen = []
    machine = Machine(REQUEST_LIFECYCLE, "r")
    for event in prefix:
        machine.fire(event)
    before = machine.state
    machine.listeners.append(lambda m, t: seen.append(t))
    assert not machine.can_fire(illegal)
    with pytest.raises(TransitionError, match=illegal.name):
        machine.fire(illegal)
    assert machine.state is before and seen == []


class Light(Enum):
    RED = 1
    GREEN = 2


class Go(Enum):
    GO = 1
    STOP = 2


def test_table_is_validated_when_defined():
    with pytest.raises(ValueError, match="two ways"):
        TransitionTable(Light, Go, [Transition(Light.RED, Go.GO, Light.GREEN),
                                    Transition(Light.RED, Go.GO, Light.RED)], Light.RED)
    with pytest.raises(ValueError, match="outside"):
        TransitionTable(Light, Go, [Transition(Light.RED, E.SCHEDULE, Light.GREEN)], Light.RED)
    with pytest.raises(ValueError, match="never reached"):
        TransitionTable(Light, Go, [], Light.RED)
    with pytest.raises(ValueError, match="terminal"):
        TransitionTable(Light, Go, [Transition(Light.GREEN, Go.STOP, Light.RED),
                                    Transition(Light.RED, Go.GO, Light.GREEN)], Light.RED,
                        terminal=[Light.GREEN])
