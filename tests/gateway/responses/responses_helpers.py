"""Shared parts of the Responses unit tests: the real leak firewall with a real codec and ledger
(as ``tests/canary/test_canary_side_strip.py`` builds it), a request body, its envelope."""

from __future__ import annotations

from typing import Any

from canary.firewall import LeakFirewall, TagIndex
from canary.injection import MarkerLedger, RequestMarkers
from canary.markers import MarkerCodec, MarkerKeyring
from contracts.plugins import PassThroughGuard, RequestInfo, StreamGuard
from gateway.responses.objects import Envelope, envelope, new_id
from gateway.responses.schemas import CreateResponseBody

CODEC = MarkerCodec(MarkerKeyring({1: bytes(range(32))}, current=1))
TENANTS = [f"tn_{i:04d}" for i in range(8)]
OWNER, VICTIM = TENANTS[0], TENANTS[3]
OWN = CODEC.issue(OWNER)
FOREIGN = CODEC.issue(VICTIM)


def firewall() -> Any:
    """``open_guard`` of the real firewall for one request of OWNER carrying OWN."""
    ledger = MarkerLedger()
    ledger.put("r1", RequestMarkers(own=frozenset({OWN.nonce})))
    tags = TagIndex(CODEC)
    tags.replace(TENANTS)
    info = RequestInfo("r1", OWNER, "m", "responses", False, 0.0, engine="e1")
    fw = LeakFirewall(CODEC, ledger=ledger, tags=tags)
    return lambda: fw.open(info)


def passthrough() -> StreamGuard:
    return PassThroughGuard()


def body(**fields: Any) -> CreateResponseBody:
    return CreateResponseBody.model_validate({"model": "m", "input": "hi", **fields})


def env(**fields: Any) -> Envelope:
    return envelope(
        body(**fields), response_id=new_id("resp"), created_at=1_700_000_000, max_output_tokens=64
    )


def split(text: str, step: int, offset: int) -> list[str]:
    cuts = [0, *range(offset, len(text), step), len(text)]
    return [text[a:b] for a, b in zip(cuts, cuts[1:], strict=False) if b > a]
