"""Validators and readers of OpenAI-shaped bodies that more than one deployable applies.

The engine's and the gateway's request schemas read explicit nulls and check stop sequences and
lone surrogates with the same functions (a request one accepts, the other accepts too); the
gateway's relay and the canary's leak firewall read a completion's choice texts the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

MAX_STOP_SEQUENCES = 4
MAX_STOP_CHARS = 1024
"""The longest stop sequence either server accepts (a longer one can never end an answer the
context holds usefully, and a 6 MB one reached the engine's body limit as a 413)."""
MAX_JSON_DEPTH = 128
"""The deepest nesting of a passed-on JSON value (``check_passed_on``): OpenAI's structured
outputs take a schema of at most 10 levels of nesting (a few JSON levels each), and below
orjson's 254, what the gateway writes an engine's body with. A value nested near the parser's own
limit (1024) broke the recursive walks over it (a 500)."""
MAX_PASSED_ON_VALUES = 200_000
"""The most JSON values (containers, strings, numbers...) the passed-on values of one request may
hold in all (``check_passed_on``, within ``one_request``; a value checked alone may hold as
many). OpenAI's structured outputs take a schema of at most 5,000 properties; every value is
walked and read on the event loop every tenant shares (by the schema and the canary), and an
8 MiB ``response_format`` of 2.8 million empty lists held it for 1.7 s after its parse."""
LONE_SURROGATE = "text is not valid Unicode (it holds a lone surrogate)"
TOO_DEEP = f"JSON nested more than {MAX_JSON_DEPTH} levels deep"
TOO_MANY = f"more than {MAX_PASSED_ON_VALUES} JSON values in the request's passed-on objects"


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
    Keys are checked too. Iterative: a value nested as deep as its parser allows (orjson: 1024)
    costs no recursion (a RecursionError was a 500)."""
    stack: list[tuple[Any, Any]] = [(value, None)]  # (value, its place: (parent's place, key))
    while stack:
        item, place = stack.pop()
        if isinstance(item, str):
            if not item.isascii() and _holds_surrogate(item):
                return _path(place, path)
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                stack.append((child, (place, key)))
                stack.append((key, (place, key)))
        elif isinstance(item, list):
            stack.extend((child, (place, at)) for at, child in reversed(list(enumerate(item))))
    return None


def _holds_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _path(place: Any, prefix: str) -> str:
    keys: list[str] = []
    while place is not None:
        place, key = place
        keys.append(str(key))
    return ".".join(([prefix] if prefix else []) + keys[::-1]) or "body"


_PARSER_CHECKED_TEXT: ContextVar[bool] = ContextVar("parser_checked_text", default=False)


@contextmanager
def parser_checked_text() -> Iterator[None]:
    """Validation of a document orjson parsed: orjson refuses a lone surrogate (Python's ``json``
    reads one), so no string of it holds one and the schemas' validators skip looking. Their walk
    was ~1 us per JSON node on the event loop: 1.2 s for an 8 MiB ``response_format`` of numbers.
    Set only around a synchronous ``model_validate``; every other caller keeps the check."""
    token = _PARSER_CHECKED_TEXT.set(True)
    try:
        yield
    finally:
        _PARSER_CHECKED_TEXT.reset(token)


def text_checked() -> bool:
    """Whether the text being validated is known to hold no lone surrogate
    (``parser_checked_text``)."""
    return _PARSER_CHECKED_TEXT.get()


_VALUES_LEFT: ContextVar[list[int] | None] = ContextVar("passed_on_values_left", default=None)


@contextmanager
def one_request() -> Iterator[None]:
    """Validation of one request: its passed-on values share one budget of
    ``MAX_PASSED_ON_VALUES`` (``check_passed_on``). Set only around a synchronous
    ``model_validate``."""
    token = _VALUES_LEFT.set([MAX_PASSED_ON_VALUES])
    try:
        yield
    finally:
        _VALUES_LEFT.reset(token)


def _descend(depth: int, level: list[Any], left: list[int]) -> int:
    """The depth of ``level``, one below ``depth``: at most ``MAX_JSON_DEPTH``, and the values
    its containers hold counted (at C speed) against ``left``."""
    depth += 1
    if depth > MAX_JSON_DEPTH:
        raise ValueError(TOO_DEEP)
    left[0] -= sum(map(len, [item for item in level if isinstance(item, dict | list)]))
    if left[0] < 0:
        raise ValueError(TOO_MANY)
    return depth


def check_passed_on(value: Any) -> None:
    """A JSON value a server only passes on (a response format, a tool's parameters...): nested
    at most ``MAX_JSON_DEPTH`` deep, holding at most what is left of ``MAX_PASSED_ON_VALUES``
    values, every string (keys too) valid Unicode; a ValueError naming the problem otherwise.
    Level by level, never recursive, each level counted before it is read; within
    ``parser_checked_text`` only the depth is checked, the containers found at C speed."""
    left = _VALUES_LEFT.get() or [MAX_PASSED_ON_VALUES]
    if text_checked():
        _check_depth(value, left)
        return
    level = [value]
    depth = 0  # ``[]`` is 1 deep, ``[[]]`` 2 (the containers in ``level`` are ``depth`` deep)
    while level:
        depth = _descend(depth, level, left)
        below: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                if _surrogate_in(item) or _surrogate_in(item.values(), below):
                    raise ValueError(LONE_SURROGATE)
            elif isinstance(item, list):
                if _surrogate_in(item, below):
                    raise ValueError(LONE_SURROGATE)
            elif isinstance(item, str) and not item.isascii() and _holds_surrogate(item):
                raise ValueError(LONE_SURROGATE)
        level = below


_CONTAINERS = frozenset({dict, list})


def _check_depth(value: Any, left: list[int]) -> None:
    level = [value] if type(value) in _CONTAINERS else []
    depth = 0
    while level:
        depth = _descend(depth, level, left)
        below: list[Any] = []
        for item in level:
            children = item.values() if type(item) is dict else item
            if not _CONTAINERS.isdisjoint(map(type, children)):  # no Python step per scalar
                if depth == MAX_JSON_DEPTH:  # a container in it, empty or not, is one deeper
                    raise ValueError(TOO_DEEP)
                below += [child for child in children if type(child) in _CONTAINERS and child]
        level = below


def _surrogate_in(items: Iterable[Any], below: list[Any] | None = None) -> bool:
    """Whether a string of ``items`` holds a lone surrogate; the containers among them are put
    in ``below``."""
    for item in items:
        if isinstance(item, str):
            if not item.isascii() and _holds_surrogate(item):
                return True
        elif below is not None and isinstance(item, dict | list):
            below.append(item)
    return False


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
