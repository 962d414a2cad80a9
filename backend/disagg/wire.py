"""Strict reading of one JSON object of the handoff's wire format (``backend.disagg.protocol``'s
codec): the exact key set, exact types, nothing guessed. Pure: no torch, no HTTP, no environment.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from backend.disagg.errors import MalformedMessage


class Reader:
    """Strict field access over one dict: exact key set, exact types."""

    def __init__(self, kind: str, payload: object, keys: frozenset[str]) -> None:
        if not isinstance(payload, dict):
            raise MalformedMessage(kind, "not an object")
        if set(payload) != keys:
            extra, missing = sorted(set(payload) - keys), sorted(keys - set(payload))
            raise MalformedMessage(kind, f"unknown fields {extra}, missing fields {missing}")
        self.kind, self.payload = kind, payload

    def integer(self, key: str, minimum: int = 0) -> int:
        value = self.payload[key]
        if type(value) is not int or value < minimum:
            raise MalformedMessage(self.kind, f"{key} must be an integer >= {minimum}")
        return value

    def opt_integer(self, key: str) -> int | None:
        return None if self.payload[key] is None else self.integer(key)

    def number(self, key: str) -> float:
        value = self.payload[key]
        if type(value) not in (int, float):
            raise MalformedMessage(self.kind, f"{key} must be a number")
        return float(value)

    def text(self, key: str) -> str:
        value = self.payload[key]
        if not isinstance(value, str) or not value or len(value) > 256:
            raise MalformedMessage(self.kind, f"{key} must be a non-empty string")
        return value

    def opt_text(self, key: str) -> str | None:
        return None if self.payload[key] is None else self.text(key)

    def flag(self, key: str) -> bool:
        value = self.payload[key]
        if type(value) is not bool:
            raise MalformedMessage(self.kind, f"{key} must be a boolean")
        return value

    def pairs(self, key: str) -> tuple[tuple[int, float], ...]:
        """A list of ``[token id, number]`` pairs (biases, alternatives' logprobs)."""
        value = self.payload[key]
        if not isinstance(value, list) or not all(is_pair(item) for item in value):
            raise MalformedMessage(self.kind, f"{key} must be a list of [token id, number] pairs")
        return tuple((item[0], float(item[1])) for item in value)

    def integers(self, key: str) -> tuple[int, ...]:
        value = self.payload[key]
        if not isinstance(value, list) or any(type(v) is not int or v < 0 for v in value):
            raise MalformedMessage(self.kind, f"{key} must be a list of non-negative integers")
        return tuple(value)

    def each(self, key: str, parse: Callable[[object], _T]) -> tuple[_T, ...]:
        value = self.payload[key]
        if not isinstance(value, list):
            raise MalformedMessage(self.kind, f"{key} must be a list")
        return tuple(parse(item) for item in value)

    def sub(self, key: str) -> object:
        return self.payload[key]


_T = TypeVar("_T")


def is_pair(item: object) -> bool:
    return (
        isinstance(item, list)
        and len(item) == 2
        and type(item[0]) is int
        and item[0] >= 0
        and type(item[1]) in (int, float)
    )


def keys_of(cls: type) -> frozenset[str]:
    return frozenset(cls.__dataclass_fields__)  # type: ignore[attr-defined]


def build(kind: str, make: Callable[[], _T]) -> _T:
    try:
        return make()
    except (ValueError, KeyError) as exc:
        raise MalformedMessage(kind, str(exc)) from exc
