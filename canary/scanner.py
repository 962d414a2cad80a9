"""Streaming leak scanner: the engine of the canary leak firewall.

One ``StreamScanner`` guards one response stream of one request. Lifecycle (``ScannerState``):

1. OPEN: the gateway calls ``feed(chunk)`` for every upstream chunk and sends the returned
   ``ScanResult.text`` to the tenant. Text that could still be (part of) a marker is held back
   until it is decided. A chunk longer than ``SLICE`` (a whole answer, a long side field) is
   read a slice at a time and decided exactly as one pass over it would decide it, in time
   proportional to its length.
2. CUT (terminal): a result with ``cut=True`` means a marker of another tenant or another
   request was found. ``text`` is everything that is safe to deliver, ending just before the
   marker; the gateway sends it, then ends the stream with an error and stores the findings.
3. FINISHED (terminal): at the end of the upstream stream the gateway calls ``finish()``,
   which decides and flushes the held-back text (it may itself cut).

A feed or finish in a terminal state raises ``ScannerStateError``, an ``InvalidTransition``: the
state moves go through ``contracts.lifecycle.check_move``, the one transition mechanism.

**What is a marker.** A marker is recognised by what makes it one -- its tag, nonce and MAC --
not by the literal ``CNRY-``: text is read folded (``canary.folding``: case, spacing, dashes,
bars, line breaks and full-width forms undone), so ``CNRY|<body>``, ``cnry - <body>`` spaced
out, or a bare body are the same marker as ``CNRY-<body>``. Where a marker may start (a
*candidate*), in this order at each folded character:

* an anchor: ``CNRY`` folded; the 32 folded characters after it are the body, whoever's tag
  they carry (so a genuine marker of a tenant no index knows is still found when its prefix
  survives in some form);
* an own fragment: 8 folded characters of one of this request's own markers, anywhere but at
  its tag -- a copy with a character bent (a forbidden letter, sampling noise) still loses
  every 8 characters it shares with the marker;
* a known tag: 8 folded characters that are the tag of the owner or of a tenant in the index;
  the 32 from there are the body.

Anything else is ordinary text and goes out at once. What is held back: a recognised candidate
until it is decided, and a literal ``CNRY-`` begun at the end of the text (the usual copy: a
marker copied as written never shows even its prefix). The last ``UNDECIDED`` (7) folded
characters delivered are kept as *context*, so a candidate that began in them is still
recognised when the rest arrives: at most those 7 characters -- of a marker written with no
prefix at all, or of a bent prefix -- have gone out then, never a whole tag.

What happens to a candidate's body (up to 32 folded characters of its run):

* complete and genuine (the MAC verifies):
  - the owner's tag and one of ``own_nonces`` -> stripped (the tenant never sees its own
    marker, so it can neither replay it nor learn its tag);
  - the owner's tag and one of ``carried_nonces`` (markers the client itself sent in this
    request: only a key holder, i.e. a canary probe, can have one) -> delivered as it is;
  - the owner's tag, another nonce -> CONFIRMED ``cross_request`` finding, cut;
  - another tag -> CONFIRMED ``cross_tenant`` finding, cut (victim named when the index knows
    the tag).
* damaged (a bad MAC, or fewer than 32 characters before the run ended):
  - a known *foreign* tag -> SUSPECTED ``cross_tenant`` finding, cut. Without an anchor the copy
    must also not contradict the tag's key id (the 2 characters after it), so ordinary text
    needs 48 matching bits, not 40, to be cut. With 23 visible characters the finding carries
    the key id and nonce (``decode_visible``) for the issue-record lookup;
  - the owner's tag -> stripped (a same-tenant damaged copy is far more often the model mangling
    the tenant's own marker than a leak; ``cross_request`` is only ever CONFIRMED), unless a
    known foreign tag starts in the 32 characters it would strip: that copy is cut as if a
    prefix stood before it (an engine can copy the owner's tag from the request's own marker),
    and a whole genuine marker overlapping the owner's tag is decided on its own;
  - an own fragment -> the characters that match the own marker are stripped;
  - after the literal prefix ``CNRY-`` -> the upper-case base32 run after it is stripped,
    whatever its characters (the look-alike rule: no oracle for the tenant's own tag, see
    below), unless a known foreign tag starts inside the run: that copy is cut as if the prefix
    stood right before it (a few characters put between the prefix and another tenant's marker
    must not make the strip swallow it); ``CNRY-`` with no base32 character after it shows
    nothing and is delivered;
  - anything else -> delivered (a bent prefix before a tag nobody has is ordinary text).

No oracle: what is delivered, stripped or cut, and when, never depends on part of the owner's
tag. A literal ``CNRY-`` look-alike is stripped whatever its characters (a tenant that asked the
model to repeat ``CNRY-`` + guesses used to learn its tag one character at a time); without the
literal prefix a damaged copy is held and stripped only when it shows the owner's whole tag (40
bits, which nobody can guess) or 8 characters of this request's own marker. The count of strips
(``redactions``) is the same for every kind of candidate.

How much of a foreign marker goes out before a cut, through ``feed`` and ``finish``: none of it
when it keeps its prefix in some form (a bent prefix itself may show), at most 7 characters of
it when it has none (the context). ``expose`` (text that cannot be held back: a side field the
gateway forwards as it is) lets a held candidate out only while it shows fewer than 8 body
characters; a longer one is decided now, as if its copy ended there: a known foreign tag cuts
(SUSPECTED); anything else cuts as undecided, without a finding.

The scanner judges the text as the tenant receives it: after a strip it reads the held text
again with the stripped part gone, so a strip cannot assemble a marker out of the text around
it. Text delivered before a candidate became one is not taken back.

It reads folded throughout, fields that go out as the engine sent them (ids, keys) too: reading
those for the literal ``CNRY-`` alone let a marker written without its prefix in a later value go
out whole (``canary.firewall`` keeps their cost down instead).

Limits: markers disguised by an encoding (reversed, base64, ROT13, letters between the
characters) or written with homoglyphs of other scripts are not recognised in an answer
(``canary.evidence`` looks for such forms in the *request*); a genuine marker of a tenant the
index does not know yet (created on another replica since the last refresh) is found only while
its prefix survives in some form. ``own_nonces``, ``carried_nonces`` and the keyring are read once,
at construction.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from canary.candidates import (
    UNDECIDED,
    Action,
    CandidateReader,
    Finding,
    KnownTags,
)
from canary.folding import (
    ANCHOR,
    BYTE_SEPARATORS,
    BYTE_UPPER,
    MAX_GAP,
    fold,
    fold_ascii,
    has_marker_characters,
)
from canary.markers import BODY_CHARS, NONCE_BYTES, PREFIX, TAG_CHARS, MarkerCodec
from contracts.lifecycle import InvalidTransition, check_move

__all__ = ["MAX_HOLDBACK", "UNDECIDED", "Finding", "KnownTags", "ScanResult", "StreamScanner"]

MAX_HOLDBACK = (len(ANCHOR) + BODY_CHARS) * (MAX_GAP + 1) + MAX_GAP
"""The most characters a scanner ever holds back: an anchor and a body, spaced out to the limit."""

CONTEXT_CHARS = UNDECIDED * (MAX_GAP + 1)
"""Delivered text the fast path keeps as context: enough to hold the last ``UNDECIDED``
characters of any run that may still go on (more is read again, and decided the same way: a
candidate looks forward). A full pass keeps exactly those characters."""
_LITERAL_ENDS = tuple(PREFIX[:k] for k in range(1, len(PREFIX) + 1))
SLICE = 256
"""A longer chunk is read this many characters at a time (``StreamScanner.feed``): a pass reads
what is held and the next slice, so a chunk costs time in proportion to its length (one pass over
all of it read the whole rest again after every strip: 32 KiB of ``CNRY-A `` took 8.6 s)."""


def reader_for(
    codec: MarkerCodec,
    *,
    owner_tenant_id: str,
    own_nonces: Iterable[bytes],
    known_tags: KnownTags | None = None,
    carried_nonces: Iterable[bytes] = (),
) -> CandidateReader:
    """The candidate rules for streams of ``owner_tenant_id``'s request with these markers
    (checked: nonces of ``NONCE_BYTES``, an owner)."""
    own = frozenset(own_nonces)
    carried = frozenset(carried_nonces) - own
    if any(len(n) != NONCE_BYTES for n in own | carried):
        raise ValueError(f"own and carried nonces must be {NONCE_BYTES} bytes each")
    if not owner_tenant_id:
        raise ValueError("owner_tenant_id must be a non-empty string")
    return CandidateReader(
        codec,
        owner=owner_tenant_id,
        own_nonces=own,
        carried_nonces=carried,
        known_tags=known_tags,
    )


def passes(reader: CandidateReader, text: str) -> bool:
    """Whether a fresh scanner reading with ``reader``, fed ``text`` and finished, delivers it
    unchanged and finds nothing: an ASCII text in which no candidate can start (no anchor, no
    tag or own window, folded: ``CandidateReader.quiet``) and that does not end as the literal
    prefix begins. (Both passes read the same folded characters; the final one decides nothing
    where no candidate starts.)"""
    return text.isascii() and reader.quiet(fold_ascii(text)) and not text.endswith(_LITERAL_ENDS)


def passes_all(reader: CandidateReader, texts: Sequence[str]) -> bool:
    """``passes`` of every one of ``texts``, in one check of them joined: folding is per
    character and ``CandidateReader.quiet`` looks for substrings (an anchor, a window), so a
    candidate that can start in one text can start in the joined folded text too; and no text
    may end as the literal prefix begins. False may be wrong (a window spanning two texts, when
    the caller asks of each)."""
    joined = "".join(texts)
    return (
        joined.isascii()
        and reader.quiet(fold_ascii(joined))
        and not any(text.endswith(_LITERAL_ENDS) for text in texts)
    )


def passes_after(reader: CandidateReader, context: str, text: str) -> str | None:
    """``passes`` of ``text`` read after ``context`` (the folded characters that ended what was
    read before it, at most ``UNDECIDED``: a candidate that began there reaches into ``text``):
    the folded characters that end both, the context for what follows, when no candidate can
    start in them; else None (a scanner must read ``context`` and ``text``)."""
    if not text.isascii() or text.endswith(_LITERAL_ENDS):
        return None
    folded = context + fold_ascii(text)
    return folded[-UNDECIDED:] if reader.quiet(folded) else None


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
class ScanResult:
    """What may be sent now (``text``), what was found, and whether the stream must end."""

    text: str
    findings: tuple[Finding, ...] = ()
    cut: bool = False
    # characters at the end of what earlier slices of the same chunk delivered that must not go
    # out after all (``StreamScanner._feed_slices`` takes them back: never set in what ``feed``
    # returns)
    taken_back: int = 0

    def __repr__(self) -> str:
        chars = len(self.text)
        return f"ScanResult(text=<{chars} chars>, findings={self.findings!r}, cut={self.cut})"


NOTHING = ScanResult("")
"""The result that delivers nothing and finds nothing (shared: results are immutable)."""


class StreamScanner:
    """Scans one response stream of ``owner_tenant_id``; see the module docstring."""

    __slots__ = (
        "_context",
        "_delivered",
        "_tail",
        "_pending",
        "_reader",
        "_redactions",
        "_state",
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
        self._start(
            reader_for(
                codec,
                owner_tenant_id=owner_tenant_id,
                own_nonces=own_nonces,
                known_tags=known_tags,
                carried_nonces=carried_nonces,
            )
        )

    @classmethod
    def reading_with(cls, reader: CandidateReader) -> StreamScanner:
        """A scanner that reads with ``reader`` (``reader_for``): the scanners of one request's
        answer (its choices and side fields) share one, built once. A reader keeps nothing of a
        read but the ``origin`` every read sets first, and reads run one at a time."""
        scanner = cls.__new__(cls)
        scanner._start(reader)
        return scanner

    def _start(self, reader: CandidateReader) -> None:
        self._reader = reader
        self._pending = ""  # undecided text (never more than MAX_HOLDBACK)
        self._context = ""  # the delivered text a marker may still continue
        self._tail = ""  # its last UNDECIDED folded characters
        self._delivered = 0
        self._redactions = 0
        self._state = ScannerState.OPEN

    @property
    def state(self) -> ScannerState:
        return self._state

    @property
    def held(self) -> int:
        """How many characters are held back right now (never more than ``MAX_HOLDBACK``)."""
        return len(self._pending)

    @property
    def watching(self) -> bool:
        """Whether text fed now may continue something: held text, or the delivered context."""
        return bool(self._pending or self._context)

    @property
    def redactions(self) -> int:
        """How many candidates were stripped so far (each counts one, whatever its kind)."""
        return self._redactions

    def feed(self, chunk: str) -> ScanResult:
        """Scan the next chunk; return what is safe to deliver now."""
        if self.passes(chunk):
            return ScanResult(text=chunk) if chunk else NOTHING
        if len(chunk) > SLICE:
            return self._feed_slices(chunk)
        context = self._context
        return self._scan(context + self._pending + chunk, final=False, floor=len(context))

    def _feed_slices(self, chunk: str) -> ScanResult:
        """A long chunk, ``SLICE`` characters at a time, decided as one pass over it would decide
        it: what a slice delivers is kept here until the chunk is read, so a candidate that began
        in it (at most the context's characters, ``UNDECIDED`` folded ones) is taken back and
        stripped or cut from where it began, as in one pass."""
        out: list[str] = []
        produced = 0  # characters of this chunk delivered so far
        for at in range(0, len(chunk), SLICE):
            context = self._context
            floor = len(context)  # the context ends where delivery ended
            result = self._scan(
                context + self._pending + chunk[at : at + SLICE],
                final=False,
                floor=floor,
                lo=floor - min(produced, floor),
            )
            if result.taken_back:
                produced -= result.taken_back
                _take_back(out, result.taken_back)
            out.append(result.text)
            produced += len(result.text)
            if result.cut:
                return ScanResult("".join(out), result.findings, cut=True)
        return ScanResult("".join(out)) if produced else NOTHING

    def passes(self, chunk: str) -> bool:
        """Deliver ``chunk`` as it is when it cannot touch a marker (``feed``'s usual chunk):
        nothing is held back or watched and it has no character that can be part of one, or
        nothing is held, it is ASCII, and no candidate can start in the folded tail of what was
        delivered and this chunk (nor a literal prefix at its end). True: it was delivered (the
        caller sends it unchanged, as ``feed`` would have returned it; the folded tail and the
        context moved on); False: nothing happened, it must go through ``feed``'s scan. One
        call per streamed chunk: ``fold_ascii`` is applied inline."""
        if self._state is not _OPEN:
            self._require_open()
        pending, context = self._pending, self._context
        if pending or context or has_marker_characters(chunk):
            if pending or not chunk.isascii():
                return False
            folded = self._tail + chunk.encode("ascii").translate(
                BYTE_UPPER, BYTE_SEPARATORS
            ).decode("ascii")
            if not self._reader.quiet(folded) or chunk.endswith(_LITERAL_ENDS):
                return False
            self._tail = folded[-UNDECIDED:]
            self._context = (context + chunk)[-CONTEXT_CHARS:]
        self._delivered += len(chunk)
        return True

    def carried(self) -> tuple[str, str]:
        """What the next chunk is read after besides what is held: the delivered context and
        its folded tail (``StreamGuard.carried``)."""
        return self._context, self._tail

    def finish(self) -> ScanResult:
        """End of the upstream stream: decide and flush everything held back."""
        self._require_open()
        context = self._context
        return self._scan(context + self._pending, final=True, floor=len(context))

    def expose(self) -> ScanResult | None:
        """The held-back text is about to be delivered anyway (a field that cannot be held back):
        None if that is safe (no held candidate shows 8 body characters, counting those of the
        delivered context it began in), else a cut result,
        with a SUSPECTED finding when the candidate shows a known foreign tag and without
        findings when it is undecided. The scanner stays OPEN after None (the candidate may still
        complete, and then cuts as usual); see the module docstring."""
        self._require_open()
        # read from the context on: a candidate written without its prefix may have begun in the
        # characters delivered before it was recognised (at most 7 of them)
        context = self._context
        view = fold(context + self._pending)
        self._reader.origin = self._delivered - len(context)
        cursor = 0
        while (verdict := self._reader.first(view, cursor, True)) is not None:
            if verdict.action is Action.CUT or verdict.shown >= TAG_CHARS:
                self._transition(ScannerState.CUT)
                self._pending = self._context = self._tail = ""
                finding = verdict.finding if verdict.action is Action.CUT else None
                return ScanResult(text="", findings=() if finding is None else (finding,), cut=True)
            cursor = view.index_at(verdict.end)
        return None

    def __repr__(self) -> str:
        return f"StreamScanner(state={self._state}, delivered={self._delivered}, held={self.held})"

    # -- one pass ---------------------------------------------------------------------------

    def _scan(self, buf: str, *, final: bool, floor: int, lo: int | None = None) -> ScanResult:
        """Decide what of ``buf`` may go out; ``buf[:floor]`` went out before (the context): a
        candidate that began there is held, stripped or cut from ``floor`` on -- or from where it
        began, when that is at or after ``lo``: ``buf[lo:floor]`` went out in the same chunk and
        is taken back (``ScanResult.taken_back``)."""
        reader = self._reader
        reader.origin = self._delivered - floor
        lo = floor if lo is None else lo
        taken = 0
        cursor = 0  # the folded characters before it are decided
        while True:
            view = fold(buf)
            verdict = reader.first(view, cursor, final)
            if verdict is None:
                hold = len(buf)
                break
            start = max(verdict.start, lo)
            if start < floor:  # it began in what this chunk delivered: take that back
                taken += floor - start
                floor = start
            if verdict.action is Action.HOLD:
                hold = start
                break
            if verdict.action is Action.CUT:
                return self._close(buf[floor:start], ScannerState.CUT, verdict.finding, taken)
            if verdict.action is Action.STRIP and verdict.end > start:
                # Judge the text as it will be received: read it again without the candidate,
                # from the first character whose candidate could reach past it.
                cursor = max(0, verdict.at - (len(ANCHOR) + BODY_CHARS - 1))
                buf = buf[:start] + buf[verdict.end :]
                self._redactions += 1
            else:
                cursor = view.index_at(verdict.end)
        if final:
            return self._close(buf[floor:], ScannerState.FINISHED, None, taken)
        self._pending = buf[hold:]
        before = len(view.chars) if hold == len(buf) else view.index_at(hold)
        self._tail = view.chars[max(0, before - UNDECIDED) : before]
        if not self._tail:
            self._context = ""
        else:  # from the first of those characters, if its run may still go on
            first, last = view.pos(before - len(self._tail)), view.pos(before - 1)
            self._context = buf[first:hold] if hold - last - 1 <= MAX_GAP else ""
        return self._deliver(buf[floor:hold], taken)

    def _deliver(self, text: str, taken: int) -> ScanResult:
        if not text and not taken:
            return NOTHING  # all held back: the usual result while a word arrives
        self._delivered += len(text) - taken
        return ScanResult(text=text, taken_back=taken)

    def _close(
        self, text: str, state: ScannerState, finding: Finding | None, taken: int
    ) -> ScanResult:
        self._transition(state)
        self._pending = self._context = self._tail = ""
        self._delivered += len(text) - taken
        findings = () if finding is None else (finding,)
        cut = state is ScannerState.CUT
        return ScanResult(text=text, findings=findings, cut=cut, taken_back=taken)

    def _require_open(self) -> None:
        if self._state in TERMINAL:
            raise ScannerStateError(
                "scanner", "", self._state, ScannerState.OPEN, "no more text can be scanned"
            )

    def _transition(self, new: ScannerState) -> None:
        check_move(TRANSITIONS, "scanner", "", self._state, new)
        self._state = new


def _take_back(parts: list[str], count: int) -> None:
    """Remove the last ``count`` characters of ``parts`` joined."""
    while count:
        last = parts.pop()
        if len(last) > count:
            parts.append(last[:-count])
            return
        count -= len(last)
