"""The leak firewall: the gateway's ``GuardFactory``, one ``StreamScanner`` per guarded stream.

Lifecycle: the relay calls ``LeakFirewall.open(info)`` once per choice of a response (and once
for the fields around the texts); each ``FirewallGuard`` wraps a fresh scanner for the request's
tenant with the request's own and carried nonces (``MarkerLedger``) and the tenant tag index.
``feed``/``finish`` return what may be delivered, or a ``CanaryCut`` carrying the scanner's
findings, which the gateway hands to ``on_cut`` (the runtime stores them, fires metrics and
quarantines the engine). A side field that goes out as it is asks ``exposed()`` first (see
``StreamScanner.expose``). Memory: a scanner holds at most ``MAX_HOLDBACK`` (36) characters, and
the relay opens at most ``MAX_CHOICES`` + 1 guards per response.

``TagIndex`` maps every tenant's tags (under every key id) to its id, so a foreign marker names its
victim without a lookup. Two tenants sharing a 40-bit tag (about n**2 / 2**41) make that tag
ambiguous: it names nobody, a complete marker with it still cuts (its MAC proves it), and the
victim is then found through the marker's issue record.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from canary.injection import MarkerLedger
from canary.markers import MarkerCodec
from canary.scanner import NOTHING, Finding, ScanResult, StreamScanner
from contracts.openai import choice_texts
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
_NOTHING = Emit("")  # shared: an Emit is immutable, and most held-back feeds deliver nothing


@dataclass(frozen=True, slots=True)
class CanaryCut(Cut):
    """A cut by the firewall, with the findings that caused it (ids and tags only)."""

    findings: tuple[Finding, ...] = field(default=(), repr=False)


class TagIndex:
    """tag -> tenant id over every key id; ambiguous (colliding) tags name nobody."""

    def __init__(self, codec: MarkerCodec) -> None:
        self._codec = codec
        self._tags: dict[bytes, str | None] = {}
        self._tenants: frozenset[str] = frozenset()

    def __len__(self) -> int:
        return len(self._tags)

    def lookup(self, tag: bytes) -> str | None:
        return self._tags.get(tag)

    def add(self, tenant_id: str) -> None:
        """Index one tenant now (a tenant created on another replica since the last refresh)."""
        if tenant_id not in self._tenants:
            _add(self._tags, self._codec, tenant_id)
            self._tenants = self._tenants | {tenant_id}

    def replace(self, tenant_ids: Iterable[str]) -> None:
        """Rebuild from every tenant (runs in a worker thread; the swap is one assignment)."""
        tags: dict[bytes, str | None] = {}
        tenants = frozenset(tenant_ids)
        for tenant_id in sorted(tenants):
            _add(tags, self._codec, tenant_id)
        self._tags, self._tenants = tags, tenants


def _add(tags: dict[bytes, str | None], codec: MarkerCodec, tenant_id: str) -> None:
    for tag in codec.tenant_tags(tenant_id):
        if tag not in tags:
            tags[tag] = tenant_id
        elif tags[tag] != tenant_id and tags[tag] is not None:
            log.error(
                "canary: tenant tag collision involving tenant %s; tag made ambiguous", tenant_id
            )
            tags[tag] = None


class FirewallGuard(StreamGuard):
    """``StreamGuard`` over one ``StreamScanner``, built on the first text that needs it (most
    side fields never do: see ``skippable``)."""

    __slots__ = ("_make", "_scanner")

    def __init__(self, make: Callable[[], StreamScanner]) -> None:
        self._make = make
        self._scanner: StreamScanner | None = None

    def feed(self, text: str) -> Emit | Cut:
        scanner = self._scanner
        if scanner is None:
            scanner = self._scanner = self._make()
        if scanner.pass_through(text):  # most chunks: no "C", nothing held back
            return Emit(text)
        return _verdict(scanner.feed(text))

    def finish(self) -> Emit | Cut:
        if self._scanner is None:
            return _NOTHING
        return _verdict(self._scanner.finish())

    def exposed(self) -> Cut | None:
        """The text fed so far goes out as it is, held-back text included (a side field that is
        not rewritten): None if that is safe, else the Cut that must end the stream first
        (``StreamScanner.expose``). An undecided candidate is no finding: it ends the stream as an
        upstream error, and nothing is stored or quarantined."""
        if self._scanner is None or self._scanner.held == 0:
            return None
        result = self._scanner.expose()
        if result is None:
            return None
        if result.findings:
            return CanaryCut(
                code=ISOLATION_CODE, message=CUT_MESSAGE, status=502, findings=result.findings
            )
        return Cut(code=UNDECIDED_CODE, message=UNDECIDED_MESSAGE, status=502)

    def skippable(self, text: str) -> bool:
        """Whether feeding ``text`` now could change no finding: nothing is held back and the text
        has no ``C`` (every marker and every held-back prefix starts with one). The relay skips
        such side-field values; only the scanner's delivered-character count would differ."""
        return "C" not in text and (self._scanner is None or self._scanner.held == 0)

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


class LeakFirewall:
    """``GuardFactory`` of the gateway: every response of every tenant is scanned."""

    def __init__(self, codec: MarkerCodec, *, ledger: MarkerLedger, tags: TagIndex) -> None:
        self._codec = codec
        self._ledger = ledger
        self._tags = tags
        self.capabilities = GuardCapabilities(side_prefilter=self.side_prefilter)

    @staticmethod
    def side_prefilter(raw_json: str, obj: dict[str, Any] | None = None) -> bool:
        """Whether a side string of ``obj`` (parsed from ``raw_json``) may hold a ``C`` (every
        marker starts with one): the relay skips side fields of events without. Every ``C`` of a
        JSON text lies in one of its strings (keys included), and without a ``\\u0043`` escape
        each decoded ``C`` is one of them, so when the choice texts (not side strings) account
        for all of them no side string has one. The usual streamed chunk: one token, with or
        without a ``C``, and ids and keys without."""
        if "C" not in raw_json:
            return "\\u0043" in raw_json
        if obj is None or "\\u0043" in raw_json:
            return True
        return raw_json.count("C") > sum(text.count("C") for text in choice_texts(obj))

    def open(self, info: RequestInfo) -> FirewallGuard:
        self._tags.add(info.tenant_id)
        markers = self._ledger.get(info.request_id)

        def make() -> StreamScanner:
            return StreamScanner(
                self._codec,
                owner_tenant_id=info.tenant_id,
                own_nonces=markers.own,
                carried_nonces=markers.carried,
                known_tags=self._tags.lookup,
            )

        return FirewallGuard(make)
