"""Content-checked load for the fault scenarios: every request asks for its own marker back.

One request (``ask``): mint a marker for the tenant with the canary codec, send the bundled
model's echo chat (the marker in the system message, ``Repeat the reference code.`` last) as a
stream through the gateway, read the stream to its end (or drop it early when told), and classify
what the client saw:

- ``ok``: HTTP 200, the stream ended with ``[DONE]``, the text holds this request's marker;
- ``error``: a non-200 answer, with its OpenAI-style ``error.code`` (a body without one is
  ``unclear_<status>``: a finding in itself);
- ``cut``: a 200 stream that ended with an OpenAI-style error event (its ``code``);
- ``wrong``: a 200 stream that ended cleanly without this request's marker, or that ended with
  neither ``[DONE]`` nor an error event (a silently cut stream);
- ``cancelled``: the client dropped the stream itself.

Any marker other than the request's own (verified or not, whole or cut off: the load run's
``foreign_markers``) counts as leaked. Marker text is never printed: results carry counts and
codes only.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

import httpx

from bench.fault_stack import MODEL_NAME, Tenant
from canary.markers import MARKER_CHARS, MarkerCodec, MarkerKeyring
from kvguard.load.content import foreign_markers

REFERENCE_REQUEST = "Repeat the reference code."
REQUEST_ID_HEADER = "x-kvguard-request-id"
_STREAMS = itertools.count()


def codec_for(canary_key: str) -> MarkerCodec:
    return MarkerCodec(MarkerKeyring({1: canary_key.encode()}, current=1))


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: str  # ok | error | cut | wrong | cancelled
    code: str | None
    status: int | None
    request_id: str | None
    leaked: int = 0
    seconds: float = 0.0
    ended: float = field(default_factory=time.monotonic)
    marker: str = ""  # a "wrong" answer's own marker (to ask the engine itself, engine_copies)


@dataclass(slots=True)
class Live:
    """What the load's streams are doing now, for a fault that must land mid-stream.

    ``waiting``: the open streams that have started (their first event came) and delivered no
    text yet, i.e. that have their whole answer still to come. Not the streams delivering text:
    the gateway's leak firewall holds the echoed marker back until it is whole, so an answer's
    text arrives at its very end. ``cut``: the 200 streams that ended with an error event so far.
    """

    waiting: set[int] = field(default_factory=set)
    cut: int = 0


@dataclass(slots=True)
class _Read:
    text: list[str] = field(default_factory=list)
    error: str | None = None
    done: bool = False
    events: int = 0


def echo_body(marker_text: str, *, max_tokens: int = MARKER_CHARS + 4) -> dict[str, object]:
    return {
        "model": MODEL_NAME,
        "messages": [
            {"role": "system", "content": f"Reference code: {marker_text}"},
            {"role": "user", "content": REFERENCE_REQUEST},
        ],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
    }


def _error_code(raw: bytes, status: int) -> str:
    try:
        error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        error = None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) and code else f"unclear_{status}"


def _feed(read: _Read, line: str) -> None:
    if not line.startswith("data:"):
        return
    data = line[5:].strip()
    if data == "[DONE]":
        read.done = True
        return
    obj = json.loads(data)
    read.events += 1
    if "error" in obj:
        error = obj["error"]
        read.error = (error.get("code") if isinstance(error, dict) else None) or "unclear_event"
        return
    for choice in obj.get("choices") or []:
        read.text.append((choice.get("delta") or {}).get("content") or "")


async def ask(
    client: httpx.AsyncClient,
    tenant: Tenant,
    codec: MarkerCodec,
    *,
    drop_after_events: int | None = None,
    admitted: Callable[[], Awaitable[None]] | None = None,
    live: Live | None = None,
) -> Outcome:
    """One echo request through the gateway, classified (see the module docstring).

    ``admitted`` is awaited once the gateway answered (any status), before the body is read.
    """
    marker = codec.issue(tenant.id).text
    started = time.perf_counter()
    read, status, request_id = _Read(), None, None
    live, stream = live or Live(), next(_STREAMS)
    try:
        body = echo_body(marker)
        async with client.stream(
            "POST", "/v1/chat/completions", json=body, headers=tenant.headers
        ) as r:
            status, request_id = r.status_code, r.headers.get(REQUEST_ID_HEADER)
            if admitted is not None:
                await admitted()
            if status != 200:
                code = _error_code(await r.aread(), status)
                return Outcome("error", code, status, request_id, 0, time.perf_counter() - started)
            async for line in r.aiter_lines():
                _feed(read, line)
                if read.error or read.done:
                    break
                if any(read.text):
                    live.waiting.discard(stream)
                elif read.events:
                    live.waiting.add(stream)
                if drop_after_events is not None and read.events >= drop_after_events:
                    leaked = foreign_markers("".join(read.text), marker)
                    took = time.perf_counter() - started
                    return Outcome("cancelled", None, status, request_id, leaked, took)
    except (httpx.TransportError, ValueError) as exc:
        read.error = read.error or f"transport_{exc.__class__.__name__}"
    finally:
        live.waiting.discard(stream)
    text = "".join(read.text)
    leaked, took = foreign_markers(text, marker), time.perf_counter() - started
    if read.error is not None:
        kind = "cut" if status == 200 else "error"
        live.cut += kind == "cut"
        return Outcome(kind, read.error, status, request_id, leaked, took)
    if read.done and marker in text:
        return Outcome("ok", None, status, request_id, leaked, took)
    code = "no_own_marker" if read.done else "silent_cut"
    return Outcome("wrong", code, status, request_id, leaked, took, marker=marker)


async def engine_copies(engine_url: str, engine_token: str, marker: str) -> bool:
    """Whether the engine itself, asked the same echo directly (greedy, no gateway), answers with
    the marker, computed from scratch: as a tenant of its own, so no cached prefix of the load's
    tenant is reused. When it does not, a gateway answer without it is the model's copy error."""
    oracle = f"fault-oracle-{uuid.uuid4().hex}"
    headers = {"Authorization": f"Bearer {engine_token}", "X-Kvguard-Tenant": oracle}
    body = {**echo_body(marker), "stream": False}
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(engine_url + "/v1/chat/completions", json=body, headers=headers)
    r.raise_for_status()
    return marker in r.json()["choices"][0]["message"]["content"]


async def clients(
    url: str,
    tenant: Tenant,
    codec: MarkerCodec,
    *,
    n_clients: int,
    until: asyncio.Event,
    min_requests: int = 1,
    drop_after_events: int | None = None,
    timeout_s: float = 60.0,
    live: Live | None = None,
) -> list[Outcome]:
    """``n_clients`` closed-loop clients, each sending at least ``min_requests`` and going on
    until ``until`` is set; every outcome in the order they ended."""
    outcomes: list[Outcome] = []

    async def one(client: httpx.AsyncClient) -> None:
        sent = 0
        while sent < min_requests or not until.is_set():
            outcome = await ask(
                client, tenant, codec, drop_after_events=drop_after_events, live=live
            )
            outcomes.append(outcome)
            sent += 1
            await asyncio.sleep(0.02 if outcome.kind in ("ok", "cancelled") else 0.2)

    async with httpx.AsyncClient(base_url=url, timeout=timeout_s) as client:
        await asyncio.gather(*(one(client) for _ in range(n_clients)))
    return outcomes


async def hold_cap(url: str, tenant: Tenant, codec: MarkerCodec) -> list[Outcome]:
    """``max_concurrency`` streams open at the same time: every one must be admitted (200) and
    echo its marker, which only happens if no slot leaked during the fault."""
    n = tenant.max_concurrency
    arrived, everyone = [0], asyncio.Event()

    async def admitted() -> None:
        arrived[0] += 1
        if arrived[0] == n:
            everyone.set()
        await asyncio.wait_for(everyone.wait(), 30)

    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return list(
            await asyncio.gather(*(ask(client, tenant, codec, admitted=admitted) for _ in range(n)))
        )


def codes(outcomes: Iterable[Outcome]) -> dict[str, int]:
    """Outcomes by kind and code: ``ok``, ``error:<code>``, ``wrong:<code>``, ``cancelled``."""
    counts = Counter(o.kind if o.code is None else f"{o.kind}:{o.code}" for o in outcomes)
    return dict(sorted(counts.items()))
