"""The one transition mechanism of the engine: a lifecycle is an enum and a table of moves.

Every lifecycle in ``backend/`` (a request's ``RequestState``, a page's ``PageState``, both sides
of a handoff) is one ``StrEnum`` with a table ``{state: the states it may move to}``; terminal
states map to the empty set. ``check_move`` is the single place that refuses a move the table
lacks, with ``InvalidTransition`` naming the subject, its id and both states. ``Machine`` holds
one subject's state in a table, for lifecycles that keep nothing else beside their state (the
handoffs); ``Request`` and ``PagePool`` keep their state next to other books and call
``check_move`` themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Generic, TypeVar

from backend.core.errors import InvalidTransition

_S = TypeVar("_S", bound=StrEnum)


def check_move(
    table: Mapping[_S, frozenset[_S]],
    subject: str,
    subject_id: str,
    current: _S,
    to: _S,
) -> None:
    """Raise ``InvalidTransition`` unless ``table`` allows ``current -> to``."""
    if to not in table[current]:
        raise InvalidTransition(subject, subject_id, current, to)


class Machine(Generic[_S]):
    """One subject's position in a transition table; ``advance`` refuses moves not in it."""

    __slots__ = ("_state", "_table", "subject", "subject_id")

    def __init__(
        self, subject: str, subject_id: str, table: Mapping[_S, frozenset[_S]], start: _S
    ) -> None:
        self.subject, self.subject_id = subject, subject_id
        self._table, self._state = table, start

    @property
    def state(self) -> _S:
        return self._state

    def can(self, to: _S) -> bool:
        return to in self._table[self._state]

    def advance(self, to: _S) -> None:
        check_move(self._table, self.subject, self.subject_id, self._state, to)
        self._state = to

    def __repr__(self) -> str:
        return f"Machine({self.subject} {self.subject_id}: {self._state})"
