"""Screening the parts of an engine's answer that are not its text: the *side* fields.

An event's text (each choice's ``delta.content``, ``message.content`` or ``text``) is rewritten by
the response guards. Every other string an engine sends reaches the client as is: ids, names,
finish reasons, error messages, usage, extension fields, logprobs tokens. A ``SideScreen`` runs
each of them through a guard too, one guard per *field path* (``x.y.*.z``, list positions
folded into ``*``; all keys form one more path), fed in order across events, so a value split
over many events or list items (a token per event) is seen whole. A side guard can only cut,
never rewrite: a foreign marker in any field never reaches the client complete (a fragment of
it may, in a field the client would have to reassemble). Its own markers are not stripped there:
an engine never copies prompt text into those fields by itself.

At most ``MAX_PATHS`` paths per response: an engine inventing field names without end is refused
(``InvalidSide``) rather than given unbounded guards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gateway.hooks import Cut, StreamGuard

MAX_PATHS = 64
KEYS_PATH = "<keys>"
TEXT_PATHS = frozenset({"choices.*.delta.content", "choices.*.message.content", "choices.*.text"})


class InvalidSide(ValueError):
    """Too many distinct field paths in one response."""


def side_fields(obj: dict[str, Any]) -> dict[str, list[str]]:
    """path -> the strings at that path, in document order, leaving out the choices' texts."""
    fields: dict[str, list[str]] = {KEYS_PATH: []}
    try:
        _visit_dict(obj, "", fields)
    except RecursionError as exc:
        raise InvalidSide("an answer nested too deeply") from exc
    return fields


def _visit_dict(value: dict[str, Any], path: str, fields: dict[str, list[str]]) -> None:
    fields[KEYS_PATH].extend(value)
    prefix = f"{path}." if path else ""
    for key, item in value.items():
        if isinstance(item, str):
            inner = prefix + key
            if inner not in TEXT_PATHS:
                fields.setdefault(inner, []).append(item)
        elif isinstance(item, dict):
            _visit_dict(item, prefix + key, fields)
        elif isinstance(item, list):
            _visit_list(item, prefix + key, fields)


def _visit_list(value: list[Any], path: str, fields: dict[str, list[str]]) -> None:
    inner = f"{path}.*"
    for item in value:
        if isinstance(item, str):
            if inner not in TEXT_PATHS:
                fields.setdefault(inner, []).append(item)
        elif isinstance(item, dict):
            _visit_dict(item, inner, fields)
        elif isinstance(item, list):
            _visit_list(item, inner, fields)


class SideScreen:
    """One guard per side-field path of one response.

    Two optional capabilities of the guards make this cheap (the leak firewall has both):

    - a guard's ``skippable(text) -> bool``: True means feeding the text now could change nothing
      the guard will ever report (the firewall: it holds nothing back and the text has no ``C``,
      which every marker starts with), so such a value costs one call, not a scan;
    - the factory's ``prefilter(raw_json) -> bool``: False means no string decoded from that JSON
      text can matter to an idle guard, so while no guard holds text back the event is not even
      walked (the firewall: neither ``C`` nor its ``\\u0043`` escape occurs in it).
    """

    def __init__(
        self,
        open_guard: Callable[[], StreamGuard],
        *,
        prefilter: Callable[[str], bool] | None = None,
        max_paths: int = MAX_PATHS,
    ):
        self._open = open_guard
        self._prefilter = prefilter
        self._max = max_paths
        self._guards: dict[str, tuple[StreamGuard, Callable[[str], bool] | None]] = {}
        self._holding: set[str] = set()  # paths whose guard may hold text back

    def feed(self, obj: dict[str, Any], *, raw: str | None = None) -> Cut | None:
        idle = not self._holding
        if idle and raw is not None and self._prefilter is not None and not self._prefilter(raw):
            return None
        for path, values in side_fields(obj).items():
            guard, skippable = self._guard(path)
            for value in values:
                if not value or (skippable is not None and skippable(value)):
                    continue
                verdict = guard.feed(value)
                if isinstance(verdict, Cut):
                    return verdict
                if skippable is None or not skippable(""):
                    self._holding.add(path)
                else:
                    self._holding.discard(path)
        return None

    def _guard(self, path: str) -> tuple[StreamGuard, Callable[[str], bool] | None]:
        entry = self._guards.get(path)
        if entry is None:
            if len(self._guards) >= self._max:
                raise InvalidSide("too many distinct fields in one answer")
            guard = self._open()
            entry = self._guards[path] = (guard, getattr(guard, "skippable", None))
        return entry

    def finish(self) -> Cut | None:
        guards, self._guards = self._guards, {}
        self._holding = set()
        for guard, _ in guards.values():
            verdict = guard.finish()
            if isinstance(verdict, Cut):
                return verdict
        return None
