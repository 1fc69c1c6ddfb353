"""A generic table-driven state machine.

Transitions are data: a tuple of ``Transition(source, event, target)`` rows, checked once when
the table is built (known states only, no event that leads two ways from one state). A
``Machine`` instance holds one current state; ``fire(event)`` looks the move up in the table
and either moves and notifies every listener, or raises ``TransitionError`` and changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Callable, Generic, Iterable, TypeVar

S = TypeVar("S", bound=Enum)
E = TypeVar("E", bound=Enum)


class TransitionError(RuntimeError):
    """An event that the table does not allow from the current state."""


@dataclass(frozen=True)
class Transition(Generic[S, E]):
    source: S
    event: E
    target: S


# listener(machine, transition) — called after the state has changed
Listener = Callable[["Machine", Transition], None]


class TransitionTable(Generic[S, E]):
    """The validated set of allowed moves."""

    def __init__(self, states: type[S], events: type[E], rows: Iterable[Transition[S, E]],
                 initial: S, terminal: Iterable[S] = ()):
        self.states, self.events, self.initial = states, events, initial
        self.terminal = frozenset(terminal)
        self._moves: dict[tuple[S, E], Transition[S, E]] = {}
        for row in rows:
            if not isinstance(row.source, states) or not isinstance(row.target, states):
                raise ValueError(f"transition {row} names a state outside {states.__name__}")
            if not isinstance(row.event, events):
                raise ValueError(f"transition {row} names an event outside {events.__name__}")
            if row.source in self.terminal:
                raise ValueError(f"transition {row} leaves terminal state {row.source.name}")
            key = (row.source, row.event)
            if key in self._moves and self._moves[key] != row:
                raise ValueError(f"event {row.event.name} from {row.source.name} leads two ways")
            self._moves[key] = row
        reachable = {initial} | {t.target for t in self._moves.values()}
        if unreachable := set(states) - reachable:
            raise ValueError(f"states never reached: {sorted(s.name for s in unreachable)}")

    def lookup(self, source: S, event: E) -> Transition[S, E] | None:
        return self._moves.get((source, event))

    @property
    def transitions(self) -> list[Transition[S, E]]:
        return list(self._moves.values())


class Machine(Generic[S, E]):
    """One instance's current state under a ``TransitionTable``."""

    __slots__ = ("table", "state", "listeners", "name")

    def __init__(self, table: TransitionTable[S, E], name: str = "",
                 listeners: Iterable[Listener] = ()):
        self.table, self.name = table, name
        self.state: S = table.initial
        self.listeners = list(listeners)

    def can_fire(self, event: E) -> bool:
        return self.table.lookup(self.state, event) is not None

    def fire(self, event: E) -> Transition[S, E]:
        """Move by ``event`` or raise ``TransitionError`` (state unchanged)."""
        move = self.table.lookup(self.state, event)
        if move is None:
            raise TransitionError(f"{self.name or 'machine'}: event {event.name} is not allowed "
                                  f"in state {self.state.name}")
        self.state = move.target
        for listener in self.listeners:
            listener(self, move)
        return move

    @property
    def is_terminal(self) -> bool:
        return self.state in self.table.terminal
