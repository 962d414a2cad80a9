"""The response guards (``contracts.plugins``) over the strings of a Responses answer.

Two kinds of strings reach a client in a Responses answer:

- *model text* (``Streams``): output text, refusal, reasoning text and summaries, function-call
  arguments. Each is a stream of deltas with a key (its kind, output index and part index) and one
  guard, fed in order; what the guard delivers replaces the delta, so the tenant's own canary marker
  is stripped and another's never goes out whole. The same text comes back complete in the
  ``*.done`` events, the finished item and the final response: ``full`` gives the text delivered
  for that key instead, so a repeat can never show what the deltas held back.
- *side strings* (``SideStrings``): everything else an engine writes (item ids, call ids, function
  names, statuses, error messages, extension fields). They go out as the engine wrote them, each
  field key one guard stream (repeats concatenate: a marker spread over a field's values across
  events is still seen whole), and a guard that holds text back is asked ``exposed()`` after each
  event: the firewall lets at most ``CNRY-`` and 7 more characters of an undecided marker through
  (the same bound as chat's side fields).

Both raise ``InvalidAnswer`` past ``MAX_STREAMS`` keys: an engine inventing indices without end is
refused rather than given unbounded guards. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from contracts.plugins import Cut, StreamGuard
from gateway.proxy.body import screen

MAX_STREAMS = 256
OpenGuard = Callable[[], StreamGuard]
Key = tuple[str | int, ...]


class InvalidAnswer(ValueError):
    """An engine answer the gateway cannot vouch for (the message names no content)."""


@dataclass(slots=True)
class _Stream:
    guard: StreamGuard
    raw: list[str] = field(default_factory=list)
    delivered: list[str] = field(default_factory=list)
    closed: bool = False


class Streams:
    """One guard per model-text stream of one response, by key."""

    __slots__ = ("_open", "_streams")

    def __init__(self, open_guard: OpenGuard) -> None:
        self._open = open_guard
        self._streams: dict[Key, _Stream] = {}

    def _get(self, key: Key) -> _Stream:
        stream = self._streams.get(key)
        if stream is None:
            if len(self._streams) >= MAX_STREAMS:
                raise InvalidAnswer("too many text streams in one answer")
            stream = self._streams[key] = _Stream(self._open())
        return stream

    def feed(self, key: Key, text: str) -> str | Cut:
        """The next delta of ``key``: the text to deliver now (possibly "") or the Cut."""
        stream = self._get(key)
        if stream.closed:
            raise InvalidAnswer("text after its part was done")
        stream.raw.append(text)
        verdict = stream.guard.feed(text)
        if isinstance(verdict, Cut):
            return verdict
        if verdict.text:
            stream.delivered.append(verdict.text)
        return verdict.text

    def close(self, key: Key) -> str | Cut:
        """``key`` is done: the text its guard still held (to deliver now), or the Cut."""
        stream = self._get(key)
        if stream.closed:
            return ""
        stream.closed = True
        verdict = stream.guard.finish()
        if isinstance(verdict, Cut):
            return verdict
        if verdict.text:
            stream.delivered.append(verdict.text)
        return verdict.text

    def text(self, key: Key) -> str:
        """What was delivered for ``key`` so far."""
        stream = self._streams.get(key)
        return "".join(stream.delivered) if stream is not None else ""

    def full(self, key: Key, text: str) -> str | Cut:
        """The complete text an engine repeats for ``key`` (a done event, a finished item): the
        text delivered for it instead. A repeat that extends the deltas feeds the rest first; one
        that contradicts them is screened whole on a fresh guard (never shown as the engine wrote
        it)."""
        stream = self._streams.get(key)
        raw = "".join(stream.raw) if stream is not None else ""
        if text == raw:
            return self.text(key)
        if text.startswith(raw) and (stream is None or not stream.closed):
            fed = self.feed(key, text[len(raw) :])
            return fed if isinstance(fed, Cut) else self.text(key)
        return screen(self._open(), text)

    def open_keys(self) -> list[Key]:
        return [key for key, stream in self._streams.items() if not stream.closed]

    def close_all(self) -> Cut | list[tuple[Key, str]]:
        """Close every open stream: the first Cut, or each key's tail (non-empty ones)."""
        tails: list[tuple[Key, str]] = []
        for key in self.open_keys():
            tail = self.close(key)
            if isinstance(tail, Cut):
                return tail
            if tail:
                tails.append((key, tail))
        return tails


class SideStrings:
    """Cut-only guards over the strings an engine writes around the model text, one per field
    key, fed in order across events (``skippable`` values cost one call)."""

    __slots__ = ("_guards", "_holding", "_open")

    def __init__(self, open_guard: OpenGuard) -> None:
        self._open = open_guard
        self._guards: dict[str, StreamGuard] = {}
        self._holding: set[str] = set()

    @property
    def idle(self) -> bool:
        """No guard holds text back (so an event a prefilter clears needs no walk)."""
        return not self._holding

    def feed(self, values: Iterable[tuple[str, str]]) -> Cut | None:
        """(field key, value) pairs of one event, in order; then the exposure check."""
        for key, value in values:
            guard = self._guards.get(key)
            if guard is None:
                if len(self._guards) >= MAX_STREAMS:
                    raise InvalidAnswer("too many distinct fields in one answer")
                guard = self._guards[key] = self._open()
            if not value or guard.skippable(value):
                continue
            verdict = guard.feed(value)
            if isinstance(verdict, Cut):
                return verdict
            if guard.skippable(""):
                self._holding.discard(key)
            else:
                self._holding.add(key)
        for key in sorted(self._holding):
            cut = self._guards[key].exposed()
            if cut is not None:
                return cut
        return None

    def feed_one(self, key: str, value: str) -> Cut | None:
        """One value (the usual event's one identifier): skippable while no guard holds text."""
        if not self._holding:
            guard = self._guards.get(key)
            if guard is not None and guard.skippable(value):
                return None
        return self.feed(((key, value),))

    def finish(self) -> Cut | None:
        """The end of the answer: a guard's Cut for what it held back, or None."""
        guards, self._guards, self._holding = self._guards, {}, set()
        for guard in guards.values():
            verdict = guard.finish()
            if isinstance(verdict, Cut):
                return verdict
        return None
