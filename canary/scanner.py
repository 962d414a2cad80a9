"""Streaming leak scanner: the engine of the canary leak firewall.

One ``StreamScanner`` guards one response stream of one request. Lifecycle (``ScannerState``):

1. OPEN: the gateway calls ``feed(chunk)`` for every upstream chunk and sends the returned
   ``ScanResult.text`` to the tenant. Text that could still be the start of a marker is held
   back (at most ``MAX_HOLDBACK`` = 36 characters) until it is decided.
2. CUT (terminal): a result with ``cut=True`` means a marker of another tenant or another
   request was found. ``text`` is everything that is safe to deliver, ending just before the
   marker; the gateway sends it, then ends the stream with an error and stores the findings.
3. FINISHED (terminal): at the end of the upstream stream the gateway calls ``finish()``,
   which flushes the held-back text (it may itself cut, for a truncated foreign marker).

Text that cannot be held back (a side field the gateway forwards as it is, ``expose()``): the
caller delivers what the scanner holds anyway, and asks first. A held candidate of at most 12
characters (``CNRY-`` and less than a whole tag, ``MAX_EXPOSED``) may go out. A longer one is
decided now, as if its copy ended here: with a known foreign tag it cuts (SUSPECTED); anything
else -- the start of the request's own marker included -- cuts as undecided, without a finding. So
at most ``CNRY-`` and 7 body characters of any marker pass that way, and whether they are the
owner's changes nothing.

A feed or finish in a terminal state raises ``ScannerStateError``, an ``InvalidTransition``: the
state moves go through ``contracts.lifecycle.check_move``, the one transition mechanism.

What happens to each candidate (``CNRY-`` followed by a run of base32 characters):

* complete (32 characters) and genuine (MAC verifies):
  - the owner's tag and one of ``own_nonces`` -> stripped silently (the tenant never sees its
    own marker, so it can neither replay it nor learn its tag);
  - the owner's tag and one of ``carried_nonces`` (markers the client itself sent in this
    request: only a key holder, i.e. a canary probe, can have one) -> delivered as it is, so a
    probe can check that the answer copied its marker;
  - the owner's tag, another nonce -> CONFIRMED ``cross_request`` finding, cut;
  - another tag -> CONFIRMED ``cross_tenant`` finding, cut (victim tenant named when
    ``known_tags`` knows the tag).
* damaged (broken by a non-base32 character, truncated at the end of the stream, or 32
  characters with a bad MAC):
  - at least the 8 tag characters are visible and they are a known *foreign* tag ->
    SUSPECTED ``cross_tenant`` finding, cut. A damaged copy carrying a victim's tag is evidence
    of a leak; delivering it would also hand the victim's tag to this tenant. When at least 23
    body characters show the key id and nonce (``decode_visible``) and the tag is the victim's
    under that key id, the finding carries them, so the victim's request can be looked up in the
    issue records (which must name the same tenant: the nonce is not authenticated);
  - anything else (the owner's tag, a tag nobody has, fewer than 8 characters) -> stripped
    silently, all alike. No oracle: whether a candidate's characters match the owner's tag
    changes nothing the tenant can observe (it used to: a damaged copy that was a prefix of the
    owner's tag was stripped and any other delivered, and a tenant asking the model to repeat
    guesses learned its tag in about 130 requests).
  A damaged marker with the owner's tag may come from another request of the same tenant, but
  far more often it is the model mangling its own marker: it is not reported, and
  ``cross_request`` is only ever a CONFIRMED finding.
* ``CNRY-`` followed by no base32 character, ``CNRX-``, lowercase, or any other near miss is not a
  marker: delivered as is.

How much of a foreign marker goes out before a cut: none of its characters (through ``feed`` and
``finish``; ``expose`` above lets up to 12 pass). Every candidate is held back from its ``C``
until it is decided, and a cut delivers exactly the text before it.

Stripping must not assemble a marker out of the text around the removed one
(``CNR`` + own marker + ``Y-...``): when the text left of a stripped marker ends with something
that could start a marker, one space is put in its place, which no marker can cross. A stripped
candidate never eats the ``CNRY-`` of an overlapping later one either: the strip stops where
the later candidate starts, and when the stream is split inside that overlap, the up to 4
overlapping characters wait in the holdback and are dropped once they turn out not to start a
marker.

Limits: the scanner keys on the literal ``CNRY-`` prefix. A marker body copied without it, or
rewritten (lowercased, spaced out, zero-width characters, homoglyphs) is not detected; markers
are a canary for accidental leaks, not a defence against a model told to disguise what it saw.
``own_nonces``, ``carried_nonces`` and the keyring are read once, at construction.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum, StrEnum

from canary.kinds import Evidence, FindingKind
from canary.markers import (
    BASE32_CLASS,
    BODY_CHARS,
    MARKER_CHARS,
    NONCE_BYTES,
    PREFIX,
    TAG_CHARS,
    MarkerCodec,
    Verified,
    decode_tag,
    decode_visible,
)
from contracts.lifecycle import InvalidTransition, check_move

MAX_HOLDBACK = MARKER_CHARS - 1
"""The most characters a scanner ever holds back: a marker missing its last character."""

MAX_EXPOSED = len(PREFIX) + TAG_CHARS - 1
"""The most characters of an undecided candidate ``expose`` lets go out: less than a whole tag."""

_CANDIDATE_RE = re.compile(re.escape(PREFIX) + "(" + BASE32_CLASS + "{0," + str(BODY_CHARS) + "})")
_OPEN_END_RE = re.compile(
    re.escape(PREFIX) + BASE32_CLASS + "{0," + str(BODY_CHARS - 1) + r"}\Z|CNRY\Z|CNR\Z|CN\Z|C\Z"
)
_BREAKER = " "
# The last character of every text that ends in a possible marker start: a base32 character or
# the prefix's "-" ("C", "N", "R", "Y" are base32 letters). A cheap test before the regex.
_OPEN_END_LAST = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567-")

KnownTags = Mapping[bytes, str] | Callable[[bytes], str | None]


class ScannerState(StrEnum):
    OPEN = "open"
    CUT = "cut"
    FINISHED = "finished"


TRANSITIONS: Mapping[ScannerState, frozenset[ScannerState]] = {
    ScannerState.OPEN: frozenset({ScannerState.OPEN, ScannerState.CUT, ScannerState.FINISHED}),
    ScannerState.CUT: frozenset(),
    ScannerState.FINISHED: frozenset(),
}
TERMINAL = frozenset({ScannerState.CUT, ScannerState.FINISHED})
_OPEN = ScannerState.OPEN  # a module global: the per-chunk state check is on the hot path


class ScannerStateError(InvalidTransition):
    """A feed or finish on a scanner that is already cut or finished."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One isolation finding. Holds no marker text; the nonce (confirmed, or read from a damaged
    copy long enough to show it) is not shown.

    ``position`` is the offset of the marker's ``C`` in the stream as the tenant receives it
    (own markers removed): for the finding that cuts, the number of characters delivered.
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


@dataclass(frozen=True, slots=True)
class ScanResult:
    """What may be sent now (``text``), what was found, and whether the stream must end."""

    text: str
    findings: tuple[Finding, ...] = ()
    cut: bool = False

    def __repr__(self) -> str:
        chars = len(self.text)
        return f"ScanResult(text=<{chars} chars>, findings={self.findings!r}, cut={self.cut})"


NOTHING = ScanResult("")
"""The result that delivers nothing and finds nothing (shared: results are immutable)."""


class _Action(Enum):
    DELIVER = "deliver"
    STRIP = "strip"
    CUT = "cut"


@dataclass(slots=True)
class _Pass:
    """One pass over the undecided text; ``buf[:cursor]`` is decided (emitted or stripped)."""

    buf: str = field(repr=False)
    final: bool
    parts: list[str] = field(default_factory=list, repr=False)
    emitted: int = 0
    cursor: int = 0

    def emit_to(self, end: int) -> None:
        if end > self.cursor:
            self.parts.append(self.buf[self.cursor : end])
            self.emitted += end - self.cursor
        self.cursor = max(self.cursor, end)

    def emit_text(self, text: str) -> None:
        self.parts.append(text)
        self.emitted += len(text)


class StreamScanner:
    """Scans one response stream of ``owner_tenant_id``; see the module docstring."""

    __slots__ = (
        "_carried",
        "_carry",
        "_codec",
        "_delivered",
        "_lookup",
        "_owner",
        "_owner_tags_by_key",
        "_own_nonces",
        "_pending",
        "_state",
        "_tail",
    )

    def __init__(
        self,
        codec: MarkerCodec,
        *,
        owner_tenant_id: str,
        own_nonces: Iterable[bytes],
        known_tags: KnownTags | None = None,
        carried_nonces: Iterable[bytes] = (),
    ) -> None:
        self._codec = codec
        self._owner = owner_tenant_id
        self._own_nonces = frozenset(own_nonces)
        self._carried = frozenset(carried_nonces) - self._own_nonces
        if any(len(n) != NONCE_BYTES for n in self._own_nonces | self._carried):
            raise ValueError(f"own and carried nonces must be {NONCE_BYTES} bytes each")
        if not owner_tenant_id:
            raise ValueError("owner_tenant_id must be a non-empty string")
        # The owner's tags (an HMAC per key id) are computed on the first candidate: most
        # streams never have one. The codec and its keyring are immutable, so it is the same.
        self._owner_tags_by_key: dict[int, bytes] | None = None
        self._lookup = _as_lookup(known_tags)
        self._pending = ""  # undecided text, always a possible marker start; <= MAX_HOLDBACK
        self._carry = 0  # leading pending chars that belong to a stripped candidate
        # The last MAX_HOLDBACK delivered characters, or "" while they do not end in a possible
        # marker start: only such an end matters (``_strip``), and text without a "C" cannot
        # make one, so most deliveries leave an empty tail alone.
        self._tail = ""
        self._delivered = 0
        self._state = ScannerState.OPEN

    @property
    def state(self) -> ScannerState:
        return self._state

    @property
    def held(self) -> int:
        """How many characters are held back right now (never more than ``MAX_HOLDBACK``)."""
        return len(self._pending)

    def feed(self, chunk: str) -> ScanResult:
        """Scan the next chunk; return what is safe to deliver now."""
        if self._state is not _OPEN:
            self._require_open()
        buf = self._pending + chunk
        if self._carry == 0 and PREFIX not in buf:
            # The common case: no candidate at all, only a possible "C".."CNRY" at the end.
            hold = _trailing_prefix_start(buf)
            self._pending = buf[hold:]
            return self._deliver(buf[:hold], ())
        return self._scan(self._drop_carry(buf, final=False), final=False)

    def pass_through(self, chunk: str) -> bool:
        """Deliver ``chunk`` as it is if it cannot touch a marker: nothing is held back and it
        has no "C" (every marker and every held-back prefix starts with one). True: it was
        delivered (the caller sends it unchanged, as ``feed`` would have returned it); False:
        nothing happened, it must go through ``feed``. The fast path of most chunks."""
        if self._state is not _OPEN:
            self._require_open()
        if self._pending or self._carry or "C" in chunk:
            return False
        self._delivered += len(chunk)
        if self._tail:
            self._set_tail(chunk)
        return True

    def finish(self) -> ScanResult:
        """End of the upstream stream: decide and flush everything held back."""
        self._require_open()
        return self._scan(self._drop_carry(self._pending, final=True), final=True)

    def expose(self) -> ScanResult | None:
        """The held-back text is about to be delivered anyway (a field that cannot be held back):
        None if that is safe (no undecided candidate longer than ``MAX_EXPOSED``), else a cut
        result, with a SUSPECTED finding when the candidate shows a known foreign tag and without
        findings when it is undecided. The scanner stays OPEN after None (the candidate may still
        complete, and then cuts as usual); see the module docstring."""
        self._require_open()
        m = _CANDIDATE_RE.search(self._pending)
        if m is None or m.end() - m.start() <= MAX_EXPOSED:
            return None
        action, finding = self._classify_damaged(m.group(1), self._delivered + m.start())
        self._transition(ScannerState.CUT)
        self._pending, self._carry = "", 0
        findings = (finding,) if action is _Action.CUT and finding is not None else ()
        return ScanResult(text="", findings=findings, cut=True)

    def __repr__(self) -> str:
        return f"StreamScanner(state={self._state}, delivered={self._delivered}, held={self.held})"

    # -- one pass ---------------------------------------------------------------------------

    def _scan(self, buf: str, *, final: bool) -> ScanResult:
        p = _Pass(buf, final)
        hold = len(buf)
        search = 0
        while (m := _CANDIDATE_RE.search(buf, search)) is not None:
            start, run = m.start(), m.group(1)
            if not final and m.end() == len(buf) and len(run) < BODY_CHARS:
                hold = start  # may still complete
                break
            position = self._delivered + p.emitted + start - p.cursor
            action, finding = self._classify(m, position=position)
            if action is _Action.CUT:
                assert finding is not None
                p.emit_to(start)
                return self._close(p, ScannerState.CUT, finding)
            if action is _Action.STRIP:
                search = self._strip(p, start, m.end())
                continue
            search = start + 1  # a later candidate may overlap this look-alike's tail
        else:
            if not final:
                hold = _trailing_prefix_start(buf)
        if final:
            p.emit_to(len(buf))
            return self._close(p, ScannerState.FINISHED, None)
        hold = max(hold, p.cursor)
        p.emit_to(hold)
        self._pending = buf[hold:]
        return self._deliver("".join(p.parts), ())

    def _strip(self, p: _Pass, start: int, end: int) -> int:
        """Remove buf[start:end] (or less, see module docstring); return where to search on."""
        buf = p.buf
        stop = end
        overlap = buf.find(PREFIX, start + 1, end + len(PREFIX) - 1)
        if overlap != -1:
            stop = overlap
        elif not p.final:
            partial = _trailing_prefix_start(buf)
            if start < partial < end:
                stop = partial
                self._carry = end - partial
        p.emit_to(start)
        left = (self._tail + "".join(p.parts))[-MAX_HOLDBACK:]
        if _OPEN_END_RE.search(left) is not None:
            p.emit_text(_BREAKER)
        p.cursor = stop
        return stop

    def _drop_carry(self, buf: str, *, final: bool) -> str:
        """Drop carried characters of a stripped candidate unless they begin a new marker."""
        if self._carry == 0:
            return buf
        if buf.startswith(PREFIX):
            self._carry = 0
            return buf
        if not final and PREFIX.startswith(buf):
            return buf  # still undecided: keep carrying
        carry, self._carry = self._carry, 0
        return buf[carry:]

    def _deliver(
        self, text: str, findings: tuple[Finding, ...], *, cut: bool = False
    ) -> ScanResult:
        if not text and not findings and not cut:
            return NOTHING  # all held back: the usual result while a capitalised word arrives
        self._delivered += len(text)
        if self._tail or "C" in text:
            self._set_tail(text)
        return ScanResult(text=text, findings=findings, cut=cut)

    def _set_tail(self, text: str) -> None:
        tail = (self._tail + text)[-MAX_HOLDBACK:]
        if tail[-1:] not in _OPEN_END_LAST or _OPEN_END_RE.search(tail) is None:
            tail = ""
        self._tail = tail

    def _close(self, p: _Pass, state: ScannerState, finding: Finding | None) -> ScanResult:
        self._transition(state)
        self._pending, self._carry = "", 0
        findings = () if finding is None else (finding,)
        return self._deliver("".join(p.parts), findings, cut=state is ScannerState.CUT)

    # -- classification ---------------------------------------------------------------------

    def _classify(self, m: re.Match[str], *, position: int) -> tuple[_Action, Finding | None]:
        run = m.group(1)
        if len(run) == BODY_CHARS:
            verified = self._codec.verify(m.group(0))
            if verified is not None:
                return self._classify_genuine(verified, position)
        return self._classify_damaged(run, position)

    def _classify_genuine(self, v: Verified, position: int) -> tuple[_Action, Finding | None]:
        victim: str | None
        if v.tenant_tag == self._owner_tags().get(v.key_id):
            if v.nonce in self._own_nonces:
                return _Action.STRIP, None
            if v.nonce in self._carried:
                return _Action.DELIVER, None
            kind, victim = FindingKind.CROSS_REQUEST, self._owner
        else:
            kind, victim = FindingKind.CROSS_TENANT, self._lookup(v.tenant_tag)
        finding = Finding(
            kind=kind,
            evidence=Evidence.CONFIRMED,
            position=position,
            victim_tag=v.tenant_tag,
            victim_tenant=victim,
            key_id=v.key_id,
            victim_nonce=v.nonce,
        )
        return _Action.CUT, finding

    def _classify_damaged(self, run: str, position: int) -> tuple[_Action, Finding | None]:
        if not run:
            return _Action.DELIVER, None  # "CNRY-" and no body character: it shows nothing
        tag = decode_tag(run[:TAG_CHARS]) if len(run) >= TAG_CHARS else None
        victim = None if tag is None else self._lookup(tag)
        if tag is None or victim is None or victim == self._owner:
            # Stripped whatever its characters are: whether they match the owner's tag must
            # change nothing the tenant can observe (no oracle for its own tag).
            return _Action.STRIP, None
        key_id, nonce = self._visible_nonce(run, tag, victim)
        finding = Finding(
            kind=FindingKind.CROSS_TENANT,
            evidence=Evidence.SUSPECTED,
            position=position,
            victim_tag=tag,
            victim_tenant=victim,
            key_id=key_id,
            victim_nonce=nonce,
        )
        return _Action.CUT, finding

    def _visible_nonce(self, run: str, tag: bytes, victim: str) -> tuple[int | None, bytes | None]:
        """(key id, nonce) of a damaged marker when it shows them and its tag is ``victim``'s under
        that key id (a key id this keyring lacks, or another tag, shows nothing usable)."""
        visible = decode_visible(run)
        if visible is None or visible.key_id is None or visible.nonce is None:
            return None, None
        if visible.key_id not in self._codec.keyring.key_ids:
            return None, None
        if self._codec.tenant_tag(victim, key_id=visible.key_id) != tag:
            return None, None
        return visible.key_id, visible.nonce

    def _owner_tags(self) -> dict[int, bytes]:
        """key id -> the owner's tag, computed on the first candidate."""
        if self._owner_tags_by_key is None:
            codec, owner = self._codec, self._owner
            self._owner_tags_by_key = {
                kid: codec.tenant_tag(owner, key_id=kid) for kid in codec.keyring.key_ids
            }
        return self._owner_tags_by_key

    def _require_open(self) -> None:
        if self._state in TERMINAL:
            raise ScannerStateError(
                "scanner", "", self._state, ScannerState.OPEN, "no more text can be scanned"
            )

    def _transition(self, new: ScannerState) -> None:
        check_move(TRANSITIONS, "scanner", "", self._state, new)
        self._state = new


def _trailing_prefix_start(buf: str) -> int:
    """Where a trailing proper prefix of ``CNRY`` starts (it may begin a marker), else len."""
    c = buf.rfind("C", max(0, len(buf) - (len(PREFIX) - 1)))
    if c != -1 and PREFIX.startswith(buf[c:]):
        return c
    return len(buf)


def _as_lookup(known_tags: KnownTags | None) -> Callable[[bytes], str | None]:
    if known_tags is None:
        return _no_lookup
    if isinstance(known_tags, Mapping):
        return known_tags.get
    return known_tags


def _no_lookup(tag: bytes) -> str | None:
    return None
