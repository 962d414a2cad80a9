"""The one transition mechanism of kvguard: a lifecycle is an enum and a table of moves.

Every lifecycle (the engine's requests, pages and both sides of a handoff, the gateway's request
phases and tenant statuses, the canary's stream scanner) is one ``StrEnum`` with a table
``{state: the states it may move to}``; terminal states map to the empty set. ``check_move`` is
the single place that refuses a move the table lacks, with ``InvalidTransition`` naming the
subject, its id (when it has one) and both states. ``Machine`` holds one subject's state in a
table, for lifecycles that keep nothing else beside their state (the handoffs); the others keep
their state next to other books and call ``check_move`` themselves.

A refused move is always a bug in the code that asked for it, never a client's error: the engine
answers it with a 500 (``invalid_state_transition``). Pure: standard library only.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Generic, TypeVar

from contracts.errors import KvguardError

_S = TypeVar("_S", bound=StrEnum)


class InvalidTransition(KvguardError):
    """A lifecycle move that the lifecycle's transition table does not allow."""

    code = "invalid_state_transition"
    http_status = 500

    def __init__(
        self, subject: str, subject_id: str, from_state: str, to_state: str, problem: str = ""
    ) -> None:
        self.subject = subject
        self.subject_id = subject_id
        self.from_state = from_state
        self.to_state = to_state
        self.problem = problem
        who = f"{subject} {subject_id}:" if subject_id else subject
        suffix = f": {problem}" if problem else ""
        message = f"{who} {from_state} -> {to_state} is not allowed{suffix}"
        super().__init__(message, subject, subject_id, from_state, to_state, problem)

    def details(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "subject": self.subject,
            "from_state": self.from_state,
            "to_state": self.to_state,
        }


def check_move(
    table: Mapping[_S, frozenset[_S]],
    subject: str,
    subject_id: str,
    current: _S,
    to: _S,
) -> None:
    """Raise ``InvalidTransition`` unless ``table`` allows ``current -> to`` (``subject_id`` may
    be empty for a subject without one, such as a gateway request's phase)."""
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
