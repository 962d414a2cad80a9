"""Where a marker may start in folded text, and what to do with it: the scanner's judgement. Pure.

A ``CandidateReader`` belongs to one ``StreamScanner`` (one stream of one request) and reads a
``canary.folding.Folded`` view of the text the scanner holds. Its ``first`` returns the first
``Verdict`` from a text offset on -- HOLD (may still become a marker: keep it back), STRIP
(remove it), KEEP (a marker the client itself sent: deliver it as it is), CUT (end the stream
before it) -- or None when nothing there can be a marker. What each candidate is and why is told
in ``canary.scanner``'s docstring; the rules live here, one method per kind of candidate.

A reader reads every candidate above in folded text. Only recognised candidates (and a literal
``CNRY-`` begun at the end) are held back: ordinary text is not delayed, and the text of an event
is not shifted into later ones (logprobs tokens stay with their logprobs). The scanner keeps the
last ``UNDECIDED`` folded characters it delivered as *context*, so a candidate that began there is
still recognised: at most those 7 characters of a marker written with no prefix at all, or of a
bent prefix, have gone out when it is (never a whole tag, never a nonce or MAC).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Protocol

from ahocorasick_rs import AhoCorasick

from canary.folding import ANCHOR, Folded
from canary.kinds import Evidence, FindingKind
from canary.markers import (
    BODY_CHARS,
    KEY_ID_CHARS,
    PREFIX,
    TAG_CHARS,
    KnownTag,
    MarkerCodec,
    Verified,
    decode_visible,
    encode_tag,
    visible_key_id,
)

UNDECIDED = TAG_CHARS - 1
"""Folded characters with no decision yet: fewer than a tag."""

_PREFIX_CHARS = frozenset(PREFIX)
_LITERAL_RUN = re.compile("[A-Z2-7]{0," + str(BODY_CHARS) + "}")


@dataclass(frozen=True, slots=True)
class TagSet:
    """Known tags (tag text -> whose) and the automaton that finds them in folded text (None: no
    tag is known). Replaced whole, never changed: a reader takes one attribute per chunk."""

    texts: Mapping[str, KnownTag] = field(repr=False)
    windows: AhoCorasick | None = field(repr=False)

    @classmethod
    def of(cls, texts: Mapping[str, KnownTag]) -> TagSet:
        return cls(texts, AhoCorasick(list(texts)) if texts else None)


class LiveTags(Protocol):
    """A live index (``canary.firewall.TagIndex``): ``current`` is replaced whole when it
    changes, so a reader that reads it once per chunk sees one consistent set."""

    @property
    def current(self) -> TagSet: ...


class FixedTags:
    """A set of tags that never changes, read like a live index."""

    __slots__ = ("current",)

    def __init__(self, texts: Mapping[str, KnownTag]) -> None:
        self.current = TagSet.of(texts)


KnownTags = Mapping[str, KnownTag] | LiveTags
"""tag text -> whose: a fixed mapping, or a live index."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One isolation finding. Holds no marker text; the nonce (confirmed, or read from a damaged
    copy long enough to show it) is not shown.

    ``position`` is the offset where the marker (its anchor, when it has one) starts in the
    stream as the tenant receives it (own markers removed): for the finding that cuts a text, the
    number of characters delivered.
    """

    kind: FindingKind  # cross_tenant or cross_request
    evidence: Evidence  # confirmed or suspected
    position: int
    victim_tag: bytes
    victim_tenant: str | None
    key_id: int | None
    victim_nonce: bytes | None = field(repr=False)

    def __repr__(self) -> str:
        return (
            f"Finding(kind={self.kind.value}, evidence={self.evidence.value}, "
            f"position={self.position}, victim_tag={self.victim_tag.hex()}, "
            f"victim_tenant={self.victim_tenant!r}, key_id={self.key_id})"
        )


class Action(Enum):
    HOLD = "hold"  # may still become a marker: hold back from ``start``
    STRIP = "strip"  # remove text[start:end]
    KEEP = "keep"  # a carried marker: deliver text[start:end] as it is
    CUT = "cut"  # end the stream before ``start``


@dataclass(frozen=True, slots=True)
class Verdict:
    """What to do with one candidate (offsets in the text being read)."""

    action: Action
    start: int
    end: int = 0
    shown: int = 0  # folded body characters the candidate shows
    finding: Finding | None = None
    at: int = 0  # the folded character ``start`` is at


class CandidateReader:
    """The candidate rules for one stream of ``owner``'s request (see the module docstring)."""

    __slots__ = (
        "_carried",
        "_codec",
        "_fragments",
        "_mine",
        "_own_nonces",
        "_owner",
        "_owner_tags",
        "_tags",
        "origin",
    )

    def __init__(
        self,
        codec: MarkerCodec,
        *,
        owner: str,
        own_nonces: frozenset[bytes],
        carried_nonces: frozenset[bytes],
        known_tags: KnownTags | None,
    ) -> None:
        self._codec = codec
        self._owner = owner
        self._own_nonces = own_nonces
        self._carried = carried_nonces
        self._tags: LiveTags
        if known_tags is None or isinstance(known_tags, Mapping):
            self._tags = FixedTags(known_tags or {})
        else:
            self._tags = known_tags
        # The owner's tags and own fragments (HMACs) are computed on the first read: the codec
        # and its keyring are immutable, so they never change.
        self._owner_tags: Mapping[str, KnownTag] | None = None
        self._fragments: Mapping[str, tuple[str, int]] | None = None
        self._mine: Mapping[str, object] | None = None
        self.origin = 0  # where the text being read starts in the delivered stream

    def first(self, view: Folded, lo: int, final: bool) -> Verdict | None:
        """The first candidate at or after folded character ``lo`` (None: there is none)."""
        chars, end = view.chars, len(view.chars) - UNDECIDED
        # Where a candidate can start: a window that is a tag or an own fragment (found in bulk,
        # up to the next anchor), or an anchor. Everything else is ordinary text.
        start = lo
        while True:
            at = chars.find(ANCHOR, start)
            stop = end if at == -1 else min(at, end)
            for i in self._window_starts(chars, start, stop):
                verdict = self._at(view, i, final)
                if verdict is not None:
                    return verdict
            if at == -1:
                break
            verdict = self._at(view, at, final)
            if verdict is not None:
                return verdict
            start = at + 1
        return None if final else _literal_start(view.text, view.offset(lo))

    def quiet(self, chars: str) -> bool:
        """Whether no candidate can start in the folded characters ``chars`` (no anchor, no window
        that is a tag or an own fragment): the scanner's fast path for ordinary text (once per
        streamed chunk)."""
        if ANCHOR in chars:
            return False
        mine = self._mine
        if mine is None:
            mine = self._own_windows()
        for window in mine:
            if window in chars:
                return False
        index = self._tags.current.windows
        return index is None or not index.find_matches_as_indexes(chars)

    def _window_starts(self, chars: str, start: int, stop: int) -> list[int]:
        """Where in ``chars[start:stop]`` a window begins that is a known tag or an own window
        (a whole window: it may reach ``UNDECIDED`` characters past ``stop``), in order."""
        if start >= stop:
            return []
        span = chars[start : stop + UNDECIDED]
        starts: set[int] = set()
        index = self._tags.current.windows
        if index is not None:
            starts.update(s for _, s, _ in index.find_matches_as_indexes(span, overlapping=True))
        for window in self._own_windows():
            at = span.find(window)
            while at != -1:
                starts.add(at)
                at = span.find(window, at + 1)
        return [start + i for i in sorted(starts)]

    def _at(self, view: Folded, i: int, final: bool) -> Verdict | None:
        """The verdict on a marker starting at folded character ``i``, or None (ordinary)."""
        if view.anchored(i):
            verdict = self._candidate(view, i + len(ANCHOR), i, final)
            if verdict is not None:
                return verdict
        if view.stop(i) - i < TAG_CHARS:
            return None
        window = view.chars[i : i + TAG_CHARS]
        fragment = self._own_fragments().get(window)
        if fragment is not None:
            return self._own_fragment(view, i, fragment, final)
        if self._tag(window) is not None:
            return self._candidate(view, i, None, final)
        return None

    def _candidate(self, view: Folded, b: int, anchor: int | None, final: bool) -> Verdict | None:
        """The verdict on the body starting at folded character ``b`` (after an anchor, or at a
        known tag). ``anchor``: where a prefix before it starts -- a folded ``CNRY``, or the head
        of a strip a foreign tag was found in (``_literal``, ``_own_tag``) -- None for none."""
        run = min(BODY_CHARS, view.stop(b) - b)
        first = b if anchor is None else anchor
        start = view.pos(first)
        if run < BODY_CHARS and view.run_open(b) and not final:
            return Verdict(Action.HOLD, start)
        body = view.chars[b : b + run]
        end = view.span(b, b + run)[1]
        if run == BODY_CHARS and (verified := self._codec.verify_body(body)) is not None:
            verdict = self._genuine(verified, start, end)
            if verdict.action is Action.STRIP:
                return self._strip(view, first, b + run, final)
            return verdict
        tag = self._tag(body[:TAG_CHARS]) if run >= TAG_CHARS else None
        if tag is not None and tag.tenant is not None and tag.tenant != self._owner:
            if anchor is not None or run < KEY_ID_CHARS or visible_key_id(body) == tag.key_id:
                finding = self._suspected(body, tag, tag.tenant, start)
                return Verdict(Action.CUT, start, end, run, finding)
            tag = None  # no anchor, and the key id contradicts the tag: ordinary text
        literal = None if anchor is None else self._literal(view, anchor, final)
        if literal is not None:
            return literal
        if tag is not None and tag.tenant == self._owner:
            return self._own_tag(view, b, run, first, final)
        return None

    def _own_tag(self, view: Folded, b: int, run: int, first: int, final: bool) -> Verdict | None:
        """Strip a damaged copy showing the owner's tag (its body at ``b``, from ``first``), unless
        a known foreign tag starts in its ``run`` after that tag: that copy is cut as if a prefix
        stood at ``first`` (the owner's tag, which an engine can copy from the request's own
        marker, must not hide another tenant's marker in the characters it strips). One that
        overlaps the owner's tag is no such copy: a chunk split can make the text as received
        join the owner's tag from the delivered context with the start of what followed it."""
        if not final and view.run_open(b) and view.stop(b) < b + run + UNDECIDED:
            return Verdict(Action.HOLD, view.pos(first))  # a tag in its tail is not whole yet
        genuine = self._genuine_in(view, b + 1, b + TAG_CHARS)
        if genuine is not None:  # a whole marker, decided on its own (_genuine)
            return self._candidate(view, genuine, None, final)
        inner = self._foreign_tag_in(view, b + TAG_CHARS, b + run)
        if inner is not None:  # _candidate cuts (or holds) there: it never comes back here
            return self._candidate(view, inner, first, final)
        return self._strip(view, first, b + run, final)

    def _literal(self, view: Folded, anchor: int, final: bool) -> Verdict | None:
        """A ``CNRY-`` look-alike: its upper-case base32 run, stripped whatever it holds (stopping
        where a later ``CNRY-`` begins inside it), unless a known foreign tag starts inside it:
        that copy is cut as if the prefix stood right before it (a strip must not swallow a marker
        written a few characters after the prefix). None when the anchor is not that literal."""
        text, start = view.text, view.pos(anchor)
        if not text.startswith(PREFIX, start):
            return None
        match = _LITERAL_RUN.match(text, start + len(PREFIX))
        assert match is not None  # the pattern matches the empty string
        end = match.end()
        if end == start + len(PREFIX):
            return None  # "CNRY-" and no body character: it shows nothing
        b = anchor + len(ANCHOR)  # the run's characters fold one to one from here
        if not final and (
            end > len(text) - len(PREFIX)  # a later "CNRY-" may start in its tail
            or (view.run_open(b) and view.stop(b) < b + end - start - len(PREFIX) + UNDECIDED)
        ):  # or a tag that starts in its tail is not whole yet
            return Verdict(Action.HOLD, start)
        later = text.find(PREFIX, start + 1, end + len(PREFIX) - 1)
        end = later if later != -1 else end
        inner = self._foreign_tag_in(view, b + 1, b + end - start - len(PREFIX))
        if inner is not None:  # _candidate cuts (or holds) there: it never comes back here
            return self._candidate(view, inner, anchor, final)
        return Verdict(Action.STRIP, start, end, end - start - len(PREFIX), at=anchor)

    def _genuine_in(self, view: Folded, lo: int, hi: int) -> int | None:
        """The first folded character in ``lo``..``hi`` (exclusive) where a known tag starts
        that begins a whole genuine marker; None if there is none. A genuine marker (its MAC
        verifies) that overlaps the owner's tag is no chunk split's accident: the owner's tag can
        be rebuilt from delivered text and that marker's first character once a strip has taken
        what stood between them, so the marker is read there, as the whole text reads it."""
        for i in self._tag_starts(view, lo, hi):
            if i + BODY_CHARS <= view.stop(i) and (
                self._codec.verify_body(view.chars[i : i + BODY_CHARS]) is not None
            ):
                return i
        return None

    def _foreign_tag_in(self, view: Folded, lo: int, hi: int) -> int | None:
        """The first folded character in ``lo``..``hi`` (exclusive) where a known tag of another
        tenant starts, whole within its run; None if there is none. Its window's whole 8
        characters are read, so where one starts decides nothing about the owner's tag."""
        for i in self._tag_starts(view, lo, hi):
            tag = self._tag(view.chars[i : i + TAG_CHARS])
            foreign = tag is not None and tag.tenant is not None and tag.tenant != self._owner
            if foreign and i + TAG_CHARS <= view.stop(i):
                return i
        return None

    def _tag_starts(self, view: Folded, lo: int, hi: int) -> list[int]:
        """Where in folded characters ``lo``..``hi`` (exclusive) a window of a known tag starts
        (its 8 characters may reach past ``hi``), in order."""
        index = self._tags.current.windows
        if index is None or lo >= hi:
            return []
        span = view.chars[lo : hi + UNDECIDED]
        return sorted(lo + s for _, s, _ in index.find_matches_as_indexes(span, overlapping=True))

    def _own_fragment(
        self, view: Folded, i: int, fragment: tuple[str, int], final: bool
    ) -> Verdict:
        """Strip what matches one of this request's own markers from folded character ``i``."""
        body, offset = fragment
        limit = min(view.stop(i) - i, BODY_CHARS - offset)
        k = TAG_CHARS
        while k < limit and view.chars[i + k] == body[offset + k]:
            k += 1
        more = k == view.stop(i) - i and offset + k < BODY_CHARS and view.run_open(i)
        if more and not final:
            return Verdict(Action.HOLD, view.pos(i))
        return self._strip(view, i, i + k, final)

    def _strip(self, view: Folded, first: int, last: int, final: bool) -> Verdict:
        """Strip folded characters ``first`` to ``last`` (exclusive), but never a later marker's
        ``CNRY`` (an anchor that begins inside it, after its start): the strip stops there, or
        waits while the text after an anchor begun at its end is not there yet."""
        start, end = view.span(first, last)
        shown = last - first
        inner = view.chars.find(ANCHOR, first + 1, last)
        if inner != -1:
            return Verdict(Action.STRIP, start, view.pos(inner), inner - first, at=first)
        for k in range(max(first + 1, last - len(ANCHOR) + 1), last):
            rest = view.chars[k : view.stop(k)]
            if rest.startswith(ANCHOR):
                return Verdict(Action.STRIP, start, view.pos(k), shown, at=first)
            if ANCHOR.startswith(rest) and view.run_open(k) and not final:
                return Verdict(Action.HOLD, start)
        return Verdict(Action.STRIP, start, end, shown, at=first)

    def _genuine(self, v: Verified, start: int, end: int) -> Verdict:
        victim: str | None
        own = self._owner_tag_texts().get(encode_tag(v.tenant_tag))
        if own is not None and own.key_id == v.key_id:
            if v.nonce in self._own_nonces:
                return Verdict(Action.STRIP, start, end, BODY_CHARS)
            if v.nonce in self._carried:
                return Verdict(Action.KEEP, start, end, BODY_CHARS)
            kind, victim = FindingKind.CROSS_REQUEST, self._owner
        else:
            known = self._tags.current.texts.get(encode_tag(v.tenant_tag))
            kind, victim = FindingKind.CROSS_TENANT, None if known is None else known.tenant
        finding = Finding(
            kind=kind,
            evidence=Evidence.CONFIRMED,
            position=self.origin + start,
            victim_tag=v.tenant_tag,
            victim_tenant=victim,
            key_id=v.key_id,
            victim_nonce=v.nonce,
        )
        return Verdict(Action.CUT, start, end, BODY_CHARS, finding)

    def _suspected(self, body: str, tag: KnownTag, victim: str, start: int) -> Finding:
        """A damaged copy showing ``victim``'s tag; its key id and nonce when it shows them and
        they are consistent with the tag."""
        visible = decode_visible(body)
        key_id = nonce = None
        if visible is not None and visible.key_id == tag.key_id and visible.nonce is not None:
            key_id, nonce = visible.key_id, visible.nonce
        return Finding(
            kind=FindingKind.CROSS_TENANT,
            evidence=Evidence.SUSPECTED,
            position=self.origin + start,
            victim_tag=self._codec.tenant_tag(victim, key_id=tag.key_id),
            victim_tenant=victim,
            key_id=key_id,
            victim_nonce=nonce,
        )

    # -- tags -------------------------------------------------------------------------------

    def _tag(self, window: str) -> KnownTag | None:
        """Whose tag the 8 folded characters are: the owner's first, then the index's."""
        own = self._owner_tag_texts().get(window)
        return own if own is not None else self._tags.current.texts.get(window)

    def _own_windows(self) -> Mapping[str, object]:
        """The owner's tags and this request's own fragments: windows that start a candidate."""
        if self._mine is None:
            tags, fragments = self._owner_tag_texts(), self._own_fragments()
            self._mine = MappingProxyType({**tags, **fragments}) if fragments else tags
        return self._mine

    def _owner_tag_texts(self) -> Mapping[str, KnownTag]:
        if self._owner_tags is None:
            self._owner_tags = _owner_tags(self._codec, self._owner)
        return self._owner_tags

    def _own_fragments(self) -> Mapping[str, tuple[str, int]]:
        """Every 8 folded characters of this request's own markers but their tags: text ->
        (the marker's body, the offset). A nonce names no key id, so every id's body counts.
        Computed once per request (its guards share this reader), kept by no cache: a marked
        request's nonces are its own, and a cache of them would only grow the long-lived heap
        that every full garbage collection walks."""
        if self._fragments is None:
            fragments = dict(_fragments(self._codec, self._owner, self._own_nonces))
            self._fragments = MappingProxyType(fragments)
        return self._fragments


@functools.lru_cache(maxsize=1024)
def _owner_tags(codec: MarkerCodec, owner: str) -> Mapping[str, KnownTag]:
    """The owner's tag texts (HMACs, one per key id): the same for every request of the tenant."""
    tags = {
        encode_tag(codec.tenant_tag(owner, key_id=kid)): KnownTag(owner, kid)
        for kid in codec.keyring.key_ids
    }
    return MappingProxyType(tags)


def _literal_start(text: str, cursor: int) -> Verdict | None:
    """HOLD at a literal ``CNRY-`` begun at the end of ``text`` (the usual copy's prefix: a
    marker copied as written never shows its prefix)."""
    if not text or text[-1] not in _PREFIX_CHARS:
        return None
    for k in range(len(PREFIX), 0, -1):
        if len(text) - k >= cursor and text.endswith(PREFIX[:k]):
            return Verdict(Action.HOLD, len(text) - k)
    return None


def _fragments(
    codec: MarkerCodec, owner: str, nonces: Iterable[bytes]
) -> Iterable[tuple[str, tuple[str, int]]]:
    for nonce in nonces:
        for key_id in codec.keyring.key_ids:
            body = codec.body_of(codec.tenant_tag(owner, key_id=key_id), key_id, nonce)
            assert body is not None  # the key id comes from this keyring
            for offset in range(1, BODY_CHARS - TAG_CHARS + 1):
                yield body[offset : offset + TAG_CHARS], (body, offset)
