"""The leak firewall: the gateway's ``GuardFactory``, one ``StreamScanner`` per guarded stream.

Lifecycle: the relay calls ``LeakFirewall.open(info)`` once per choice of a response (and once
for the fields around the texts); each ``FirewallGuard`` wraps a fresh scanner for the request's
tenant with the request's own and carried nonces (``MarkerLedger``) and the tenant tag index.
``feed``/``finish`` return what may be delivered, or a ``CanaryCut`` carrying the scanner's
findings, which the gateway hands to ``on_cut`` (the runtime stores them, fires metrics and
quarantines the engine). A side field that goes out as it is asks ``exposed()`` first (see
``StreamScanner.expose``); ``redactions()`` says how many candidates the guard stripped. Memory:
a scanner holds at most ``MAX_HOLDBACK`` characters, and the relay opens at most ``MAX_CHOICES`` + 1
guards per response.

``TagIndex`` maps every tenant's tags (under every key id) to its id, by tag bytes (the edge check
on requests) and by tag text (the scanner reads folded text), so a marker names its victim
without a lookup. Two tenants sharing a 40-bit tag (about n**2 / 2**41) make that tag ambiguous:
it names nobody, a complete marker with it still cuts (its MAC proves it), and the victim is then
found through the marker's issue record.

No side prefilter: any side string with a letter may continue a marker whose prefix was bent or
lost (``canary.folding``), so every event's side fields are screened.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from canary.candidates import CandidateReader, TagSet
from canary.folding import fold_flat, has_marker_characters
from canary.injection import MarkerLedger, RequestMarkers
from canary.markers import KnownTag, MarkerCodec, encode_tag
from canary.scanner import (
    NOTHING,
    UNDECIDED,
    Finding,
    ScannerState,
    ScanResult,
    StreamScanner,
    passes,
    passes_after,
    passes_all,
    reader_for,
)
from contracts.plugins import Cut, Emit, GuardCapabilities, RequestInfo, StreamGuard

log = logging.getLogger("kvguard.canary")

ISOLATION_CODE = "isolation_violation"
# The same text for a cut stream's error event and a cut answer's 502 (sent with
# ``x-should-retry: false``): it advises no retry, which could reach the same engine again, and
# claims nothing about recording, which happens after the cut and can fail (the finding is
# spooled then, ``canary.keeper``, but the client is not told what cannot be promised).
CUT_MESSAGE = (
    "This response was stopped because it contained data that does not belong to this request. "
    "Do not retry it automatically; give the operator its request id (the x-request-id header)."
)
UNDECIDED_CODE = "upstream_error"
UNDECIDED_MESSAGE = "the engine sent a field the gateway cannot vouch for"
# requests in flight whose scanner factory is kept (a request opens a dozen guards); each entry
# goes at the request's end (``forget``), the bound is for requests that never reach it
MAX_READERS = 1024
_NOTHING = Emit("")  # shared: an Emit is immutable, and most held-back feeds deliver nothing


@dataclass(frozen=True, slots=True)
class CanaryCut(Cut):
    """A cut by the firewall, with the findings that caused it (ids and tags only)."""

    findings: tuple[Finding, ...] = field(default=(), repr=False)


class TagIndex:
    """tag -> tenant id over every key id; ambiguous (colliding) tags name nobody.

    ``add`` runs on the event loop, ``replace`` in a worker thread: a tenant added while a
    rebuild is under way (from tenant ids read before it existed) is added to the rebuilt index
    too, under ``_lock``, which only writers take (readers read one attribute, ``current``: the
    tags and their automaton, replaced together; a ``LiveTags`` for the scanners' readers)."""

    def __init__(self, codec: MarkerCodec) -> None:
        self._codec = codec
        self.current = TagSet.of({})
        self._tenants: frozenset[str] = frozenset()
        self._lock = threading.Lock()
        self._added_meanwhile: set[str] | None = None  # while a rebuild runs: what ``add`` added

    def __len__(self) -> int:
        return len(self.current.texts)

    def lookup(self, tag: bytes) -> str | None:
        known = self.current.texts.get(encode_tag(tag))
        return None if known is None else known.tenant

    def add(self, tenant_id: str) -> None:
        """Index one tenant now (a tenant created on another replica since the last refresh)."""
        if tenant_id in self._tenants:
            return
        with self._lock:
            if self._added_meanwhile is not None:
                self._added_meanwhile.add(tenant_id)
            self._swap(self.current, self._tenants, {tenant_id})

    def replace(self, tenant_ids: Iterable[str]) -> None:
        """Rebuild from every tenant (runs in a worker thread; the swap is one assignment), unless
        they are the tenants indexed already: the usual refresh then costs nothing. A rebuild
        holds the GIL for its HMACs and automaton (about 130 ms for 10,000 tenants and two key
        ids), and every request in flight meanwhile waits for the interpreter in turns."""
        tenants = frozenset(tenant_ids)
        with self._lock:
            if tenants == self._tenants:
                return
            self._added_meanwhile = set()
        texts: dict[str, KnownTag] = {}
        for tenant_id in sorted(tenants):
            _add(texts, self._codec, tenant_id)
        built = TagSet.of(texts)  # the scanners' automaton, built here rather than on the loop
        with self._lock:
            meanwhile, self._added_meanwhile = self._added_meanwhile, None
            self._swap(built, tenants, meanwhile or ())

    def _swap(self, tags: TagSet, tenants: frozenset[str], more: Iterable[str]) -> None:
        """Install ``tags`` and ``tenants`` with ``more`` tenants added (to a copy: a set once
        installed never changes); the caller holds ``_lock``."""
        more = [tenant_id for tenant_id in more if tenant_id not in tenants]
        if more:
            texts = dict(tags.texts)
            for tenant_id in more:
                _add(texts, self._codec, tenant_id)
            tags = TagSet.of(texts)
        self.current, self._tenants = tags, tenants.union(more)


def _add(texts: dict[str, KnownTag], codec: MarkerCodec, tenant_id: str) -> None:
    for text, known in codec.known_tags([tenant_id]).items():
        other = texts.get(text)
        if other is None:
            texts[text] = known
        elif other.tenant != tenant_id and other.tenant is not None:
            log.error(
                "canary: tenant tag collision involving tenant %s; tag made ambiguous", tenant_id
            )
            texts[text] = KnownTag(tenant=None, key_id=known.key_id)


class FirewallGuard(StreamGuard):
    """``StreamGuard`` over one ``StreamScanner``, built on the first text that needs it (most
    side fields never do: see ``skippable``). A cut-only side field's guard (asked ``exposed`` or
    ``expose_whole``: a field that goes out as the engine sent it) reads folded text like any
    other, every value of the field: while no candidate can start in its values it needs no
    scanner, only the last folded characters read (``canary.scanner.passes_after``); the first
    value in which one can gets a scanner that reads those characters first."""

    __slots__ = ("_context", "_make", "_reader", "_scanner", "_steady")

    def __init__(
        self, make: Callable[[], StreamScanner], reader: CandidateReader | None = None
    ) -> None:
        self._make = make
        self._reader = reader  # the request's (``LeakFirewall.open``): for ``passes_whole``
        self._scanner: StreamScanner | None = None
        # a cut-only field's guard: the folded characters that ended its values so far, while
        # they needed no scanner (None: not a cut-only field's guard)
        self._context: str | None = None
        # (context, value) that passed and left the context as it was: the same again passes
        # (an event that repeats its id after the first events)
        self._steady: tuple[str, str] | None = None

    def feed(self, text: str) -> Emit | Cut:
        """What may be delivered of ``text`` (a cut-only field goes out as it is whatever this
        says: only a Cut and what the guard holds matter there)."""
        scanner = self._scanner
        if scanner is None:
            context = self._context
            if context is not None:
                if self._passes_after(context, text):
                    return Emit(text)
                text = context + text  # the scanner reads from where a candidate could begin
            scanner = self._scanner = self._make()
        if scanner.passes(text):  # the usual text: no candidate can start in it
            if self._context is not None:
                self._settle()
            return Emit(text)
        verdict = _verdict(scanner.feed(text))
        if self._context is not None:
            self._settle()
        return verdict

    def passes(self, text: str) -> bool:
        """A text stream's usual chunk, in one call into its scanner (``StreamScanner.passes``):
        True when no candidate can start in it (delivered as it is). A cut-only field's guard,
        and a guard not yet fed, answer through ``feed``."""
        scanner = self._scanner
        return scanner is not None and self._context is None and scanner.passes(text)

    def _settle(self) -> None:
        """A cut-only field's scanner that holds nothing goes: the folded characters it would
        read the next value after are all the guard keeps (the field is not held whatever it
        says, so only what a candidate may begin in matters). Called for cut-only fields only
        (``_context`` set): a text stream's guard keeps its scanner."""
        scanner = self._scanner
        if scanner is None:
            return
        if scanner.state is ScannerState.OPEN and not scanner.held:
            self._context = fold_flat(scanner.carried()[0])[-UNDECIDED:]
            self._scanner = None

    def finish(self) -> Emit | Cut:
        if self._scanner is None:
            return _NOTHING
        return _verdict(self._scanner.finish())

    def exposed(self) -> Cut | None:
        """The text fed so far goes out as it is, held-back text included (a side field that is
        not rewritten): None if that is safe, else the Cut that must end the stream first
        (``StreamScanner.expose``). The scanner goes on reading: a candidate it holds may still
        complete, and cuts then. An undecided candidate is no finding: it ends the stream as an
        upstream error, and nothing is stored or quarantined."""
        if self._context is None:
            self._context = ""
        scanner = self._scanner
        if scanner is None:
            return None
        result = scanner.expose() if scanner.held else None
        if result is None:
            self._settle()
            return None
        if result.findings:
            return CanaryCut(
                code=ISOLATION_CODE, message=CUT_MESSAGE, status=502, findings=result.findings
            )
        return Cut(code=UNDECIDED_CODE, message=UNDECIDED_MESSAGE, status=502)

    def carried(self) -> object:
        """The folded characters the next value is read after (a cut-only field's context, or
        its scanner's)."""
        scanner = self._scanner
        return self._context if scanner is None else scanner.carried()

    def skippable(self, text: str) -> bool:
        """Whether feeding ``text`` now could change nothing: the scanner holds and watches
        nothing and the text has no character a marker is made of (folding drops the rest, so
        the folded context is unchanged too). The relay skips such side-field values; only the
        delivered-character count would differ. ``skippable("")`` after a feed says whether the
        guard still holds or watches text (the relay then asks ``exposed`` of a cut-only
        field)."""
        scanner = self._scanner
        if scanner is not None and scanner.watching:
            return False
        return not has_marker_characters(text)

    def passes_whole(self, text: str) -> bool:
        """A whole text (a side field of a non-streaming answer: fed, then finished) goes out
        unchanged and finds nothing when no candidate can start in it (``canary.scanner.passes``):
        one check instead of a scanner's pass and its final pass."""
        reader = self._reader
        return self._scanner is None and reader is not None and passes(reader, text)

    def passes_each_whole(self, texts: Sequence[str]) -> bool:
        """Every one of ``texts`` (a whole answer's side fields, each a field's values joined)
        passes whole, told by one check of them all (``canary.scanner.passes_all``)."""
        reader = self._reader
        return self._scanner is None and reader is not None and passes_all(reader, texts)

    def expose_whole(self, text: str) -> bool:
        """A cut-only field's text in a streamed event (its values joined), in which no candidate
        can start after the folded characters read before it (``canary.scanner.passes_after``):
        fed, it would be delivered and leave only its last folded characters as context, which
        the guard keeps instead of a scanner. False when a candidate may start or a scanner
        reads the field (the relay then feeds it value by value)."""
        if self._context is None:
            self._context = ""
        return self._scanner is None and self._passes_after(self._context, text)

    def _passes_after(self, context: str, text: str) -> bool:
        """``text`` read after ``context`` needs no scanner: the context moves on (a cut-only
        field's guard with no scanner)."""
        reader = self._reader
        if self._steady == (context, text):
            return True
        after = None if reader is None else passes_after(reader, context, text)
        if after is None:
            return False
        self._context = after
        self._steady = (context, text) if after == context else None
        return True

    def redactions(self) -> int:
        """How many candidates this guard removed from what it delivered (each counts one,
        whatever its kind; a cut-only field removes nothing: it goes out as it is)."""
        scanner = self._scanner
        cut_only = self._context is not None
        return 0 if scanner is None or cut_only else scanner.redactions

    def __repr__(self) -> str:
        return f"FirewallGuard({self._scanner!r})"


def _verdict(result: ScanResult) -> Emit | Cut:
    if result is NOTHING:
        return _NOTHING
    if result.cut:
        return CanaryCut(
            code=ISOLATION_CODE, message=CUT_MESSAGE, status=502, findings=result.findings
        )
    return Emit(result.text)


_Maker = tuple[RequestMarkers, str, Callable[[], StreamScanner], CandidateReader]


class LeakFirewall:
    """``GuardFactory`` of the gateway: every response of every tenant is scanned."""

    def __init__(self, codec: MarkerCodec, *, ledger: MarkerLedger, tags: TagIndex) -> None:
        self._codec = codec
        self._ledger = ledger
        self._tags = tags
        self.capabilities = GuardCapabilities()
        self._makers: dict[str, _Maker] = {}

    def open(self, info: RequestInfo) -> FirewallGuard:
        """A guard for one text of the request's answer. The request's guards (a dozen: its
        choices and side fields) share one scanner factory and ``CandidateReader``, built on
        the first ``open`` and kept until ``forget``."""
        markers = self._ledger.get(info.request_id)
        cached = self._makers.get(info.request_id)
        if cached is not None and cached[0] is markers and cached[1] == info.tenant_id:
            return FirewallGuard(cached[2], cached[3])
        self._tags.add(info.tenant_id)
        reader = reader_for(
            self._codec,
            owner_tenant_id=info.tenant_id,
            own_nonces=markers.own,
            carried_nonces=markers.carried,
            known_tags=self._tags,
        )

        def make() -> StreamScanner:
            return StreamScanner.reading_with(reader)

        if len(self._makers) >= MAX_READERS:
            del self._makers[next(iter(self._makers))]
        self._makers[info.request_id] = (markers, info.tenant_id, make, reader)
        return FirewallGuard(make, reader)

    def forget(self, request_id: str) -> None:
        """The request ended: its scanner factory goes (its reader holds the request's markers,
        and what stays lives in the heap every full garbage collection walks)."""
        self._makers.pop(request_id, None)
