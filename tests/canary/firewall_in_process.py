"""The leak firewall in process, for the tests that drive the gateway's relays with it: one
keyring, 50 indexed tenants, a request of the first one (its own markers given), and a chat
``StreamRelay`` whose guards are that request's."""

from __future__ import annotations

from canary.firewall import LeakFirewall, TagIndex
from canary.injection import MarkerLedger, RequestMarkers
from canary.markers import MarkerCodec, MarkerKeyring
from contracts.plugins import RequestInfo
from gateway.proxy.relay import StreamRelay
from gateway.upstream.base import Endpoint

CODEC = MarkerCodec(MarkerKeyring({1: bytes(range(32)), 2: bytes(range(40, 80))}, current=2))
TENANTS = [f"tn_{i:04d}" for i in range(50)]
OWNER = TENANTS[0]


def firewall(own: frozenset[bytes] = frozenset()) -> tuple[LeakFirewall, RequestInfo]:
    ledger = MarkerLedger()
    ledger.put("r1", RequestMarkers(own=own))
    tags = TagIndex(CODEC)
    tags.replace(TENANTS)
    info = RequestInfo("r1", OWNER, "m", "chat.completions", False, 0.0, engine="e1")
    return LeakFirewall(CODEC, ledger=ledger, tags=tags), info


def new_relay(own: frozenset[bytes] = frozenset()) -> StreamRelay:
    fw, info = firewall(own)
    return StreamRelay(endpoint=Endpoint.CHAT, open_guard=lambda: fw.open(info), wants_usage=False)
