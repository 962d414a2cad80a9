"""Marker injection: the request hook that marks a sampled share of each tenant's requests.

Lifecycle of one request's markers (``RequestMarkers`` in the ``MarkerLedger``):

1. ``MarkerInjector.prepare`` (before tokens are counted) reads the markers the request itself
   carries. A genuine marker of *another* tenant refuses the request (400
   ``foreign_canary_marker``): no tenant can hold one legitimately, and echoing it would only
   frame an engine. So does ``CNRY-`` followed by the 8 characters of another known tenant's tag
   (``known_tags``), whatever comes after: the model echoing such a damaged copy would be a
   suspected finding against an innocent engine. The caller's own genuine markers (only a key
   holder, a canary probe, has them) are *carried*: delivered back as they are and recorded as
   this request's markers.
2. Otherwise, with the tenant's ``canary_sample_rate``, a fresh marker is injected and becomes the
   request's *own* marker: the firewall strips it from what the tenant receives.
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
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

from canary.markers import (
    BASE32_CLASS,
    BODY_CHARS,
    PREFIX,
    TAG_CHARS,
    MarkerCodec,
    Verified,
    decode_tag,
)
from canary.metrics import CanaryMetrics
from canary.records import MarkerRecord, RecordStore
from contracts.plugins import RequestInfo, RequestRefused
from contracts.sql import utcnow

log = logging.getLogger("kvguard.canary")

REFERENCE_LINE = "{marker}"  # the marker alone: see the module docstring
MAX_PENDING_WRITES = 1000
_MARKER_RE = re.compile(re.escape(PREFIX) + BASE32_CLASS + "{" + str(BODY_CHARS) + "}")
_TAGGED_RE = re.compile(re.escape(PREFIX) + "(" + BASE32_CLASS + "{" + str(TAG_CHARS) + "})")


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


def request_texts(body: dict[str, Any]) -> list[str]:
    """Every text of a request body the engine will read (message contents and names, prompt)."""
    texts: list[str] = []
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        texts.append(prompt)
    for message in body.get("messages") or ():
        if isinstance(message, dict):
            texts.extend(v for v in message.values() if isinstance(v, str))
    return texts


def carried_markers(codec: MarkerCodec, body: dict[str, Any]) -> list[Verified]:
    """The genuine markers a request body carries."""
    found = []
    for text in request_texts(body):
        if PREFIX not in text:
            continue
        for match in _MARKER_RE.finditer(text):
            verified = codec.verify(match.group(0))
            if verified is not None:
                found.append(verified)
    return found


def tagged_tenants(body: dict[str, Any], known_tags: Callable[[bytes], str | None]) -> set[str]:
    """The known tenants whose tag follows a ``CNRY-`` somewhere in the request's texts."""
    found: set[str] = set()
    for text in request_texts(body):
        if PREFIX not in text:
            continue
        for match in _TAGGED_RE.finditer(text):
            tag = decode_tag(match.group(1))
            tenant = None if tag is None else known_tags(tag)
            if tenant is not None:
                found.add(tenant)
    return found


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
        self._random = random or secrets.SystemRandom().random
        self._pending: set[asyncio.Task[None]] = set()

    async def prepare(self, info: RequestInfo, body: dict[str, Any]) -> dict[str, Any]:
        carried = self._carried_nonces(info, body)
        own: frozenset[bytes] = frozenset()
        out = body
        if not carried and self._sampled(info, body):
            marker = self._codec.issue(info.tenant_id)
            out = self._inject(body, marker.text)
            own = frozenset({marker.nonce})
            self._metrics.injected.labels(tenant=info.tenant_id).inc()
        marked = bool(own or carried)
        self._metrics.requests.labels(tenant=info.tenant_id, marked=str(marked).lower()).inc()
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
        found = carried_markers(self._codec, body)
        if found:
            own_tags = self._codec.tenant_tags(info.tenant_id)
            if any(v.tenant_tag not in own_tags for v in found):
                _refuse(info, "marker")
        lookup = self._known_tags
        if lookup is not None and tagged_tenants(body, lookup) - {info.tenant_id}:
            _refuse(info, "tag")
        return frozenset(v.nonce for v in found)

    def _sampled(self, info: RequestInfo, body: dict[str, Any]) -> bool:
        if info.canary_sample_rate <= 0.0:
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
