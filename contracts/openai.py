"""Validators and readers of OpenAI-shaped bodies that more than one deployable applies.

The engine's and the gateway's request schemas read explicit nulls and check stop sequences and
lone surrogates with the same functions (a request one accepts, the other accepts too); the
gateway's relay and the canary's leak firewall read a completion's choice texts the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 1024
"""The longest stop sequence either server accepts (a longer one can never end an answer the
context holds usefully, and a 6 MB one reached the engine's body limit as a 413)."""


def null_is_absent(data: Any) -> Any:
    """A request object (the body, a message, ``stream_options``) with its null members left out.

    OpenAI's schemas make the optional fields nullable, and SDKs send a null for a None (and echo
    an assistant turn back with ``refusal: null``, ``tool_calls: null``...): a null means "not
    given", the field's default. Both servers read it so before validating (a ``mode="before"``
    model validator), so a null is never refused by one and accepted by the other, and the
    gateway forwards nothing for it."""
    if isinstance(data, dict) and any(value is None for value in data.values()):
        return {key: value for key, value in data.items() if value is not None}
    return data


def check_stops(stops: list[str]) -> None:
    """The stop-sequence rules both servers share (ValueError naming the problem)."""
    if len(stops) > MAX_STOP_SEQUENCES:
        raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
    if any(not stop for stop in stops):
        raise ValueError("stop sequences must be non-empty")
    if any(len(stop) > MAX_STOP_CHARS for stop in stops):
        raise ValueError(f"stop sequences must be at most {MAX_STOP_CHARS} characters")


def check_logit_bias_keys(keys: Iterable[str]) -> None:
    """OpenAI's ``logit_bias`` maps token ids, written as decimal strings, to biases (both
    servers refuse any other key, ValueError naming it)."""
    for key in keys:
        if not key.isascii() or not key.isdigit():
            raise ValueError(f"keys must be token ids, got {key[:32]!r}")


def lone_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string in ``value`` (parsed JSON) holding a lone UTF-16 surrogate,
    which JSON may escape (``"\\ud800"``) but no text encoding can carry; None if there is none.
    Keys are checked too."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            found = lone_surrogate(key, inner) or lone_surrogate(item, inner)
            if found is not None:
                return found
    elif isinstance(value, list):
        for position, item in enumerate(value):
            found = lone_surrogate(item, f"{path}.{position}" if path else str(position))
            if found is not None:
                return found
    return None


def choice_texts(obj: dict[str, Any]) -> Iterator[str]:
    """The choices' texts of a completion or chunk (``delta.content``, ``message.content``,
    ``text``: what the gateway's choice guards screen, its side screen does not), lazily; a text
    in an unexpected shape is left out."""
    choices = obj.get("choices")
    if not isinstance(choices, list):
        return
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        for name in ("delta", "message"):
            inner = choice.get(name)
            if isinstance(inner, dict) and isinstance(text := inner.get("content"), str):
                yield text
        if isinstance(text := choice.get("text"), str):
            yield text
