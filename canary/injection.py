"""Marker injection: the request hook that marks a sampled share of each tenant's requests.

Lifecycle of one request's markers (``RequestMarkers`` in the ``MarkerLedger``):

1. ``MarkerInjector.prepare`` (before tokens are counted) reads the markers the request itself
   carries, in the form the firewall reads answers (``canary.folding``: every string of the body
   joined in order, case and separators folded, so a marker lowercased, spaced out, split across
   messages or with its dash bent is still read). A genuine marker of *another* tenant refuses
   the request (400 ``foreign_canary_marker``): no tenant can hold one legitimately, and echoing
   it would only frame an engine. So does ``CNRY`` followed by the 8 characters of another known
   tenant's tag (``known_tags``), whatever comes after: the model echoing such a damaged copy
   would be a suspected finding against an innocent engine. A body holding more than
   ``MAX_ANCHORS`` folded ``CNRY``s is refused on the count alone (400
   ``too_many_canary_prefixes``): each is work on the shared event loop and a guess at a tag.
   The caller's own genuine markers (only a key holder, a canary probe, has them) are *carried*:
   delivered back as they are and recorded as this request's markers.
2. Otherwise, with the tenant's ``canary_sample_rate``, a fresh marker is injected and becomes the
   request's *own* marker: the firewall strips it from what the tenant receives. A request that
   can bend or multiply what the model copies is never sampled (``bendable``): one with a
   ``logit_bias`` (a bias against ``-`` made the bundled model write ``CNRY|<body>``; a bias
   against a letter of the body would hand the tenant a copy one known character away from its
   genuine marker, which no firewall can tell from the model's own mistakes) or asking for more
   than one choice (``n``/``best_of`` > 1: several noisy copies of one marker can be voted back
   into it). The answer is the same either way and nothing is refused, so this tells the tenant
   nothing: sampling only watches the tenant's *own* data, so skipping it costs that tenant
   coverage on those requests and nobody else anything.
3. The firewall opens its guards with the ledger's entry (every request has one: it also holds
   the body the client sent, where a cut looks for the marker it found, ``canary.evidence``);
   ``on_finish`` pops it (the ledger holds in-flight requests only).

Where the marker goes (chosen to keep the request's meaning): chat requests get the marker alone
as the first line of the first system message (a system message holding only the marker is
added when there is none); completion prompts get the same line before the prompt
(``canary_inject_completions``). The bundled model ``kvguard-tiny`` copies a marker from anywhere
in its context when asked for "the reference code" (``backend/bundled/data.py``), so no phrase
around it is needed: the line used to be ``Reference code: <marker>``, 16 tokens more. On the
bundled byte tokenizer the marker adds 38 prompt tokens to a chat with a system message and 49
to one without (its system header), 46 on average over ``bench/bench_canary_answers.py``'s prompt
set (62 before); fewer on a BPE tokenizer. Those tokens count for capacity (a request that fits
only without the marker is sent without it: admission), never against the tenant: its tokens per
minute, its usage row and the ``usage`` in its answer are its own prompt's (``hidden_prompt_tokens``
in the gateway's request context).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from canary.evidence import strings_of
from canary.folding import ANCHOR, fold_flat
from canary.markers import BODY_CHARS, TAG_CHARS, MarkerCodec, Verified, decode_tag
from canary.metrics import CanaryMetrics
from canary.records import MarkerRecord, RecordStore
from contracts.plugins import RequestInfo, RequestRefused
from contracts.randomness import RandomBytes
from contracts.sql import utcnow

log = logging.getLogger("kvguard.canary")

REFERENCE_LINE = "{marker}"  # the marker alone: see the module docstring
MAX_PENDING_WRITES = 1000
# Folded ``CNRY``s a request body may hold. Each is a tag lookup and, with 32 characters after
# it, a MAC check, on the event loop every tenant shares: an 8 MiB body of them held it for
# 1.6-4.4 s, and was 645,000 guesses at other tenants' tags in one request. Random data holds
# about one per 720,000 base64 characters; this project's own docs and code, which discuss the
# marker, one per 17,000 characters. A body holding more is refused on the count alone, before
# any is read, so the refusal says nothing of whose tags they were.
MAX_ANCHORS = 1024


@dataclass(frozen=True, slots=True)
class RequestMarkers:
    """The nonces of one request's own (injected) and carried (client-sent) markers, and the body
    the client sent (what a cut looks for the marker in: ``canary.evidence``)."""

    own: frozenset[bytes] = field(default=frozenset(), repr=False)
    carried: frozenset[bytes] = field(default=frozenset(), repr=False)
    body: Any = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        return f"RequestMarkers(own={len(self.own)}, carried={len(self.carried)})"


NO_MARKERS = RequestMarkers()


class MarkerLedger:
    """request id -> RequestMarkers for requests in flight on this replica."""

    def __init__(self) -> None:
        self._entries: dict[str, RequestMarkers] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, request_id: str, markers: RequestMarkers) -> None:
        self._entries[request_id] = markers

    def get(self, request_id: str) -> RequestMarkers:
        return self._entries.get(request_id, NO_MARKERS)

    def pop(self, request_id: str) -> RequestMarkers:
        return self._entries.pop(request_id, NO_MARKERS)


def reference_line(marker_text: str) -> str:
    return REFERENCE_LINE.format(marker=marker_text)


def inject_chat(messages: list[dict[str, Any]], marker_text: str) -> list[dict[str, Any]]:
    """The messages with the reference line first in the system message (a new list)."""
    line = reference_line(marker_text)
    if messages and messages[0].get("role") == "system":
        first = {**messages[0], "content": f"{line}\n{messages[0].get('content', '')}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": line}, *messages]


def inject_prompt(prompt: str, marker_text: str) -> str:
    return f"{reference_line(marker_text)}\n{prompt}"


class AnchorFlood(Exception):
    """The body holds more than ``MAX_ANCHORS`` folded ``CNRY``s."""


@dataclass(frozen=True, slots=True)
class CarriedMarkers:
    """What a request body holds after a folded ``CNRY``: genuine markers, and the known tenants
    whose tag follows one without a genuine marker."""

    genuine: tuple[Verified, ...] = ()
    tagged: frozenset[str] = frozenset()


def carried_markers(
    codec: MarkerCodec,
    body: dict[str, Any],
    known_tags: Callable[[bytes], str | None] | None = None,
) -> CarriedMarkers:
    """The markers a request body carries, read as the firewall reads answers: every string of
    the body, keys included, joined in document order (``canary.evidence.strings_of``), folded
    (``canary.folding``). A marker is looked for after
    each ``CNRY`` (a bare body with its prefix removed is left to the firewall and
    ``canary.evidence``: the edge refuses what it can name cheaply, at C speed on any size)."""
    folded = fold_flat("".join(strings_of(body)))
    if folded.count(ANCHOR) > MAX_ANCHORS:
        raise AnchorFlood()
    genuine: list[Verified] = []
    tagged: set[str] = set()
    at = folded.find(ANCHOR)
    while at != -1:
        chars = folded[at + len(ANCHOR) : at + len(ANCHOR) + BODY_CHARS]
        verified = codec.verify_body(chars) if len(chars) == BODY_CHARS else None
        if verified is not None:
            genuine.append(verified)
        elif known_tags is not None and len(chars) >= TAG_CHARS:
            tenant = known_tags(_tag_bytes(chars[:TAG_CHARS]))
            if tenant is not None:
                tagged.add(tenant)
        at = folded.find(ANCHOR, at + 1)
    return CarriedMarkers(tuple(genuine), frozenset(tagged))


def _tag_bytes(chars: str) -> bytes:
    tag = decode_tag(chars)
    assert tag is not None  # folded characters are base32
    return tag


def bendable(body: dict[str, Any]) -> bool:
    """Whether the request can bend or multiply what the model copies: then it is not sampled
    (see the module docstring)."""
    if body.get("logit_bias"):
        return True
    return any(_count(body.get(name)) > 1 for name in ("n", "best_of"))


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


class SecureDraws:
    """Uniform floats in [0, 1) from the operating system's CSPRNG (what ``secrets`` reads), so
    a tenant cannot tell which of its requests will be marked: 53 bits of 8 random bytes per
    draw (``contracts.randomness``: one system call per 512 draws, where ``SystemRandom`` makes
    one per draw). The event loop draws; not for threads."""

    __slots__ = ("_bytes",)
    SCALE = 2.0**-53  # 53 random bits -> [0, 1), as ``random.random``

    def __init__(self) -> None:
        self._bytes = RandomBytes()

    def __call__(self) -> float:
        return (int.from_bytes(self._bytes.take(8), "big") >> 11) * self.SCALE


class MarkerInjector:
    """``RequestHook``: reads carried markers, injects at the tenant's rate, fills the ledger."""

    def __init__(
        self,
        codec: MarkerCodec,
        *,
        ledger: MarkerLedger,
        known_tags: Callable[[bytes], str | None] | None = None,
        records: Callable[[], RecordStore | None],
        metrics: CanaryMetrics,
        inject_completions: bool = True,
        random: Callable[[], float] | None = None,
    ) -> None:
        self._codec = codec
        self._ledger = ledger
        self._known_tags = known_tags
        self._records = records
        self._metrics = metrics
        self._inject_completions = inject_completions
        self._random = random or SecureDraws()
        self._pending: set[asyncio.Task[None]] = set()

    async def prepare(self, info: RequestInfo, body: dict[str, Any]) -> dict[str, Any]:
        carried = self._carried_nonces(info, body)
        own: frozenset[bytes] = frozenset()
        out = body
        m = self._metrics
        if not carried and self._sampled(info, body):
            marker = self._codec.issue(info.tenant_id)
            out = self._inject(body, marker.text)
            own = frozenset({marker.nonce})
            m.later(m.injected_of, (info.tenant_id,))
        marked = bool(own or carried)
        m.later(m.requests_of, (info.tenant_id, "true" if marked else "false"))
        self._ledger.put(info.request_id, RequestMarkers(own=own, carried=carried, body=body))
        for nonce in own | carried:
            self.record(nonce, info, engine=None)
        return out

    def record(self, nonce: bytes, info: RequestInfo, *, engine: str | None) -> None:
        """Write the nonce's issue record in the background (never on the request's path)."""
        store = self._records()
        if store is None:
            return
        if len(self._pending) >= MAX_PENDING_WRITES:
            self._metrics.record_errors.inc()
            return
        record = MarkerRecord(
            nonce=nonce,
            request_id=info.request_id,
            tenant_id=info.tenant_id,
            engine=engine,
            issued_at=utcnow(),
        )
        task = asyncio.create_task(self._write(store, record, replace=engine is not None))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def drain(self) -> None:
        """Wait for the record writes in flight (shutdown, tests)."""
        while self._pending:
            await asyncio.gather(*list(self._pending), return_exceptions=True)

    async def _write(self, store: RecordStore, record: MarkerRecord, *, replace: bool) -> None:
        try:
            await store.put(record, replace=replace)
        except Exception as exc:
            self._metrics.record_errors.inc()
            log.warning(
                "canary: marker record for request %s not written: %s", record.request_id, exc
            )

    def _carried_nonces(self, info: RequestInfo, body: dict[str, Any]) -> frozenset[bytes]:
        try:
            found = carried_markers(self._codec, body, self._known_tags)
        except AnchorFlood:
            log.warning(
                "canary: request %s of tenant %s holds more than %d marker prefixes; refused",
                info.request_id,
                info.tenant_id,
                MAX_ANCHORS,
            )
            raise RequestRefused(
                f"This request holds more than {MAX_ANCHORS} canary marker prefixes (CNRY, "
                "in any case or spacing); no request needs that many.",
                code="too_many_canary_prefixes",
            ) from None
        if found.genuine:
            own_tags = self._codec.tenant_tags(info.tenant_id)
            if any(v.tenant_tag not in own_tags for v in found.genuine):
                _refuse(info, "marker")
        if found.tagged - {info.tenant_id}:
            _refuse(info, "tag")
        return frozenset(v.nonce for v in found.genuine)

    def _sampled(self, info: RequestInfo, body: dict[str, Any]) -> bool:
        if info.canary_sample_rate <= 0.0 or bendable(body):
            return False
        if "messages" not in body and not self._inject_completions:
            return False
        return self._random() < info.canary_sample_rate

    @staticmethod
    def _inject(body: dict[str, Any], marker_text: str) -> dict[str, Any]:
        messages = body.get("messages")
        if isinstance(messages, list):
            return {**body, "messages": inject_chat(messages, marker_text)}
        return {**body, "prompt": inject_prompt(str(body.get("prompt", "")), marker_text)}


def _refuse(info: RequestInfo, what: str) -> NoReturn:
    log.warning(
        "canary: request %s of tenant %s carries another tenant's %s; refused",
        info.request_id,
        info.tenant_id,
        what,
    )
    raise RequestRefused(
        "This request carries a canary marker, or part of one, that belongs to another tenant.",
        code="foreign_canary_marker",
    )
