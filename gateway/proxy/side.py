"""Screening the parts of an engine's answer that are not its text: the *side* fields
(``gateway.proxy.side_fields``: which strings they are, and their field keys).

An event's text is rewritten by the response guards. Every other string an engine sends would
reach the client as is; a ``SideScreen`` runs each of them through a guard too, one guard per
field key, fed in order across events, so a value split over many events or list items (a token
per event) is seen whole: a foreign marker in any field never reaches the client complete.

Most side guards can only cut. The side fields that carry text the model wrote (``REWRITE_PATHS``:
reasoning, refusal, tool-call arguments, logprobs tokens) are *rewritten* with what their guard
delivers, exactly like the text, so the tenant's own marker is stripped there too: a reasoning
model, a tool call or the logprobs echo prompt text as readily as the answer does. A rewritten
logprobs token gets its ``bytes`` recomputed, so the marker does not survive as integers. What a
rewrite guard still holds at the end (``finish``) comes back as ``SideTail``s: appended to the
last value at that path (non-streaming, ``screen_body``) or sent as one more chunk before
``[DONE]`` (streaming, ``tail_chunk``: a valid chunk of OpenAI's schema, with the fields it needs
filled in). Left cut-only: object keys (the completions endpoint's
``top_logprobs`` maps tokens as keys) and identifiers, whose values must not shift between events.

A cut-only field goes out as the engine sent it, so text its guard holds back (a possible marker
start) still reaches the client. After the cut-only fields of a streamed event are fed, each guard
that holds text is asked (``exposed()``, optional) whether that may be seen; a ``Cut`` ends the
stream before the event goes out. The leak firewall lets at most ``CNRY-`` and 7 more characters
of an undecided marker through that way (less than the owner tag that names a tenant): so a
foreign marker sent a few characters per event shows the client no more than that fragment. A
whole answer (``screen_body``) is decided by ``finish`` before anything goes out: not asked.

(Across the ranks of ``top_logprobs`` a marker can hide in no single stream only by zig-zagging
between ranks; each rank, the sampled tokens and the text are screened.)
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from contracts.plugins import Cut, Emit, Prefilter, StreamGuard
from gateway.proxy.side_fields import (
    MAX_PATHS,
    REWRITE_KEYS,
    InvalidSide,
    Location,
    append_at,
    identities_at,
    rewrite_sites,
    set_at,
    side_fields,
)


@dataclass(frozen=True, slots=True)
class Rewritten:
    """A copy of the event with its rewritable side fields replaced by what the guards deliver."""

    obj: dict[str, Any] = field(repr=False)


@dataclass(frozen=True, slots=True)
class SideTail:
    """Text a rewrite guard still held at the end of the answer.

    ``location``: the last value seen at its path; ``identities``: the ``index`` of each list
    element on the way there (a choice's, a tool call's; None for elements without one).
    """

    location: Location
    identities: tuple[int | None, ...]
    text: str = field(repr=False)


def tail_chunk(template: dict[str, Any], tails: list[SideTail], *, chat: bool) -> dict[str, Any]:
    """One streaming chunk carrying the tails, shaped like the events they came from: on the way
    to each, every list holds elements that keep only their ``index`` (a choice, a tool call);
    the tails of one choice's logprobs share one token entry (the sampled tokens' tail, and in
    its ``top_logprobs`` each rank's tail at its rank); then completed to a valid chunk of
    OpenAI's schema (``_completed``)."""
    chunk: dict[str, Any] = {k: v for k, v in template.items() if k not in ("choices", "usage")}
    for tail in tails:
        node: Any = chunk
        identities = iter(tail.identities)
        name: str | int = ""
        for step, following in zip(tail.location, tail.location[1:], strict=False):
            if isinstance(step, int):
                identity = next(identities)
                node = _rank(node, step) if name == "top_logprobs" else _element(node, identity)
            else:
                node = node.setdefault(step, [] if isinstance(following, int) else {})
            name = step
        last = tail.location[-1]
        if isinstance(last, int):
            node.append(tail.text)  # a list of token strings (completions logprobs)
        else:
            node[last] = node.get(last, "") + tail.text
    for choice in chunk.get("choices", ()):
        _completed(choice, chat=chat)
    return chunk


TAIL_LOGPROB = 0.0
"""The logprob of a tail's token entry: the tail is no sampled token (its tokens went out with their
logprobs, their text held back), so it adds nothing to the answer's sum."""


def _completed(choice: dict[str, Any], *, chat: bool) -> None:
    """A tail chunk's choice with what OpenAI's chunk schemas require: ``finish_reason`` (null:
    the choice's own finish went out with the engine's event), a chat choice's ``delta``, a
    completion's ``text`` and ``logprobs``; a chat logprobs object's ``content`` and ``refusal``
    lists, and each token entry's ``logprob``, ``bytes`` and ``top_logprobs``; a completion's
    ``token_logprobs`` as many as its ``tokens``."""
    choice.setdefault("finish_reason", None)
    if not chat:
        choice.setdefault("text", "")
        logprobs = choice.setdefault("logprobs", None)
        if logprobs is not None and "tokens" in logprobs:
            logprobs.setdefault("token_logprobs", [TAIL_LOGPROB] * len(logprobs["tokens"]))
        return
    choice.setdefault("delta", {})
    logprobs = choice.get("logprobs")
    if logprobs is None:
        return
    for part in ("content", "refusal"):
        for entry in logprobs.setdefault(part, None) or ():
            _token_entry(entry)
            for ranked in entry.setdefault("top_logprobs", []):
                _token_entry(ranked)


def _token_entry(entry: dict[str, Any]) -> None:
    token = entry.setdefault("token", "")
    entry.setdefault("logprob", TAIL_LOGPROB)
    entry["bytes"] = list(token.encode())


def _element(items: list[Any], identity: int | None) -> dict[str, Any]:
    """The tail's element of a list: the one with this ``index`` (a choice, a tool call), or
    for a list of elements without one (a sequence: logprobs token entries) its one element."""
    if identity is None:
        if not items:
            items.append({})
        return items[-1]
    for item in items:
        if item.get("index") == identity:
            return item
    items.append({"index": identity})
    return items[-1]


def _rank(items: list[Any], rank: int) -> dict[str, Any]:
    """A rank's entry of a tail's ``top_logprobs``, at its rank (the ranks before it without a
    tail of their own get an empty entry: a rank keeps its meaning)."""
    while len(items) <= rank:
        items.append({})
    return items[rank]


class SideScreen:
    """One guard per side-field path of one response.

    Two capabilities make this cheap, a third makes cut-only fields safe (the leak firewall has
    all three; a guard without them keeps ``StreamGuard``'s defaults: never skippable, never
    exposed; a factory without a prefilter says so in its ``GuardCapabilities``):

    - a guard's ``skippable(text) -> bool``: True means feeding the text now could change nothing
      the guard will ever report or deliver (the firewall: it holds nothing back and the text has
      no ``C``, which every marker starts with), so such a value costs one call, not a scan;
    - the factory's ``prefilter(raw_json, obj) -> bool`` (``obj``: the event parsed from that
      JSON text): False means no side string of the event can matter to an idle guard, so while
      no guard holds text back the event is not even walked (the firewall: no ``\\u0043``
      escape occurs in the JSON text, and every ``C`` in it lies in the choice texts,
      ``contracts.openai.choice_texts`` -- a streamed token with a ``C`` does not make the
      event's ids and keys worth a walk);
    - a guard's ``exposed() -> Cut | None``: asked after a streamed event's cut-only fields are fed,
      while the guard holds text back (which goes out with the event anyway); a Cut ends the
      stream before the event is sent (the firewall: an undecided marker longer than ``CNRY-``
      and 7 characters).

    And two for a field's first values (a new guard), which the firewall answers with one check
    of the joined values (no candidate can start in them, ``canary.scanner.passes``):
    ``passes_whole`` (a whole answer: fed and finished, they would pass unchanged) and
    ``expose_whole`` (a streamed event: fed and then exposed, they would leave the guard holding
    nothing, only the folded characters a later value is read after; the guard starts in that
    state). A guard says what it carries from one value into the next (``carried``): an event
    whose screening moved that is not quiet, so the next one with the same side fields is read
    again rather than taken as unchanged. A whole answer
    asks first whether every field passes (``passes_each_whole``, one check of all of them): the
    usual answer then opens no guard per field.
    """

    def __init__(
        self,
        open_guard: Callable[[], StreamGuard],
        *,
        text: str,
        prefilter: Prefilter | None = None,
        max_paths: int = MAX_PATHS,
    ):
        self._open = open_guard
        self._text = text  # the text path (``text_path``): screened by the relay, not here
        self.prefilter = prefilter  # read by the relay's common-chunk path too
        self._max = max_paths
        self._guards: dict[str, StreamGuard] = {}
        self.holding: set[str] = set()  # keys whose guard may hold text back
        self._rewritten: set[str] = set()  # keys of rewritable fields
        self._last: dict[str, tuple[Location, tuple[int | None, ...]]] = {}  # rewrite keys
        self._stirs = 0  # guards opened or found holding text: a guard's state moved
        # The skeleton of the last event that moved nothing (None while a guard holds text: it
        # is set only at the end of a ``feed`` that left none holding)
        self.quiet: bytes | None = None

    def feed(
        self, obj: dict[str, Any], *, raw: str | None = None, skeleton: bytes | None = None
    ) -> Cut | Rewritten | None:
        """A Cut, the event rewritten (only when a rewritable field changed), or None.

        ``skeleton``: the event serialised with its choice's text left out (``skeleton``), when
        it has one text. The caller need not feed an event whose skeleton is ``quiet`` (the last
        quiet event's; never while a guard holds text): its side strings are that event's, in
        the same order, and those were fed to guards holding nothing and left every one of them
        holding nothing, with no guard opened (``_stirs`` did not move) and each guard carrying
        into the next event what it carried into that one (``StreamGuard.carried``: the folded
        characters a value is read after); guards in the same state read the same strings the
        same way, so feeding them again would change nothing but the delivered-character counts.
        The usual stream repeats its id, object, model and creation time in every chunk: the
        relay makes one comparison instead of a dozen guard calls."""
        idle, stirs = not self.holding, self._stirs
        carried = [guard.carried() for guard in self._guards.values()]
        verdict = self._screen(obj, raw, streamed=True)
        quiet = verdict is None and idle and not self.holding and self._stirs == stirs
        # and each guard carries into the next event what it carried into this one
        quiet = quiet and carried == [guard.carried() for guard in self._guards.values()]
        self.quiet = skeleton if quiet else None
        return verdict

    def _screen(
        self, obj: dict[str, Any], raw: str | None, *, streamed: bool
    ) -> Cut | Rewritten | None:
        idle = not self.holding
        prefilter = self.prefilter
        if idle and raw is not None and prefilter is not None and not prefilter(raw, obj):
            return None
        fields = side_fields(obj, self._text)
        if not streamed and not self._guards and self._all_pass(fields):
            fields = {}  # a whole answer whose every field passes: no guard is needed
        for key, values in fields.items():
            if key not in self._guards:  # a field's first values: they may pass at once
                guard, whole = self._guard(key), "".join(values)
                if guard.expose_whole(whole) if streamed else guard.passes_whole(whole):
                    continue
            elif streamed and self._guards[key].expose_whole("".join(values)):
                continue  # later values of a field that goes out as sent, read at once
            for value in values:
                verdict = self._feed(key, value)
                if isinstance(verdict, Cut):
                    return verdict
        if streamed and self.holding and (cut := self._exposed()) is not None:
            return cut
        if raw is not None and "\\u" not in raw and not any(k in raw for k in REWRITE_KEYS):
            return None
        changes: list[tuple[Location, str]] = []
        for key, location, value in rewrite_sites(obj):
            verdict = self._feed(key, value, rewrite=True)
            if isinstance(verdict, Cut):
                return verdict
            if verdict is not None:
                self._last[key] = (location, identities_at(obj, location))
                if verdict.text != value:
                    changes.append((location, verdict.text))
        if not changes:
            return None
        changed = copy.deepcopy(obj)
        for location, text in changes:
            set_at(changed, location, text)
        return Rewritten(changed)

    def _all_pass(self, fields: dict[str, list[str]]) -> bool:
        """Whether each field's values, joined, would pass its guard whole (``passes_whole``),
        asked of one guard for all of them (``passes_each_whole``). More fields than the bound
        go the per-field way, which refuses them."""
        if len(fields) > self._max:
            return False
        return self._open().passes_each_whole(["".join(values) for values in fields.values()])

    def _exposed(self) -> Cut | None:
        """The Cut of a cut-only field's guard whose held-back text must not go out, or None."""
        for key in sorted(self.holding - self._rewritten):
            guard = self._guards[key]
            if (cut := guard.exposed()) is not None:
                return cut
            if guard.skippable(""):  # exposed, it holds and watches nothing now
                self.holding.discard(key)
        return None

    def _feed(self, key: str, value: str, *, rewrite: bool = False) -> Emit | Cut | None:
        """The guard's verdict on ``value``, or None when it was skipped (delivered as is)."""
        guard = self._guard(key)
        if rewrite:
            self._rewritten.add(key)
        if not value or guard.skippable(value):
            return None
        verdict = guard.feed(value)
        if isinstance(verdict, Emit):
            if not guard.skippable(""):
                self.holding.add(key)
                self._stirs += 1
            else:
                self.holding.discard(key)
        return verdict

    def _guard(self, key: str) -> StreamGuard:
        guard = self._guards.get(key)
        if guard is None:
            if len(self._guards) >= self._max:
                raise InvalidSide("too many distinct fields in one answer")
            guard = self._guards[key] = self._open()
            self._stirs += 1
        return guard

    def finish(self) -> Cut | list[SideTail]:
        """A Cut, or the rewritable fields' held-back tails (cut-only fields deliver nothing)."""
        guards, self._guards = self._guards, {}
        self.holding = set()
        tails: list[SideTail] = []
        for key, guard in guards.items():
            verdict = guard.finish()
            if isinstance(verdict, Cut):
                return verdict
            last = self._last.get(key)
            if verdict.text and last is not None:
                tails.append(SideTail(last[0], last[1], verdict.text))
        return tails

    def screen_body(self, body: dict[str, Any], *, raw: str | None = None) -> Cut | dict[str, Any]:
        """A whole non-streaming answer (``raw``: its JSON text, for the prefilter): a Cut, or the
        body (a changed copy if anything changed)."""
        verdict = self._screen(body, raw, streamed=False)
        if isinstance(verdict, Cut):
            return verdict
        tails = self.finish()
        if isinstance(tails, Cut):
            return tails
        out = body if verdict is None else verdict.obj
        if tails:
            out = copy.deepcopy(out) if verdict is None else out
            for tail in tails:
                append_at(out, tail.location, tail.text)
        return out
