"""What the leak firewall keeps between calls: one reader per request while it is in flight
(shared by its guards, dropped when it ends), and the tenant tag index across refreshes."""

from __future__ import annotations

import threading
from typing import cast

from canary_harness import TEST_CANARY_KEY

from canary.config import CanarySettings
from canary.firewall import LeakFirewall, TagIndex
from canary.injection import MarkerLedger, RequestMarkers
from canary.markers import KnownTag, MarkerCodec, MarkerKeyring
from canary.runtime import CanaryRuntime
from contracts.plugins import Emit, RequestInfo, RequestReport

CODEC = MarkerCodec(MarkerKeyring({1: bytes(range(32)), 2: bytes(range(40, 80))}, current=2))
TENANTS = [f"tn_{i:04d}" for i in range(50)]


def test_a_requests_guards_share_one_reader_built_with_its_current_markers() -> None:
    """``LeakFirewall.open``: the guards of one request (its choices and side fields) read with
    one ``CandidateReader``, built once; markers put for the request after that (a new ledger
    entry) get a reader of their own, so no guard strips with a stale set of own nonces."""
    ledger = MarkerLedger()
    fw = LeakFirewall(CODEC, ledger=ledger, tags=TagIndex(CODEC))
    info = RequestInfo("r1", "tn_a", "m", "chat.completions", True, 0.0, engine="e1")
    first, second = fw.open(info), fw.open(info)
    assert first.feed("hello") and second.feed("world")
    assert first._scanner is not None and second._scanner is not None
    assert first._scanner._reader is second._scanner._reader
    own = CODEC.issue("tn_a", nonce=b"own-req1")
    ledger.put("r1", RequestMarkers(own=frozenset({own.nonce})))
    third = fw.open(info)
    assert third.feed(f"a {own.text} b") == Emit("a  b")  # the new own marker is stripped
    assert third._scanner is not None and third._scanner._reader is not first._scanner._reader


async def test_a_requests_reader_goes_when_the_request_ends() -> None:
    """The firewall keeps a request's scanner factory (its reader, which holds the request's
    markers) while the request is in flight, and drops it when the request ends (the runtime's
    ``on_finish``, called at the gateway's single exit). It used to keep the last 1,024
    requests' whatever their state: a long-lived heap that each full garbage collection of the
    serving gateway walked, and that stretched its pauses after a burst."""
    runtime = CanaryRuntime(CanarySettings(canary_key=TEST_CANARY_KEY))
    info = RequestInfo("r1", "tn_a", "m", "chat.completions", False, 0.0)
    first, second = runtime.firewall.open(info), runtime.firewall.open(info)
    assert first.feed("hello") and second.feed("world")
    assert first._scanner is not None and second._scanner is not None
    assert first._scanner._reader is second._scanner._reader  # in flight: one reader
    report = RequestReport(info, "completed", 200, True, None, None, None, False, None)
    await runtime.on_finish(report)
    later = runtime.firewall.open(info)
    assert later.feed("again")
    assert later._scanner is not None and later._scanner._reader is not first._scanner._reader


def test_a_tag_refresh_with_the_same_tenants_keeps_the_index() -> None:
    """The periodic tag refresh reads every tenant id; when they are the ones indexed, the index
    stands (no HMAC, no automaton: a rebuild holds the GIL about 130 ms at 10,000 tenants, every
    ``canary_tag_refresh_s``, and requests wait for it). A tenant added or gone rebuilds it."""
    tags = TagIndex(CODEC)
    tags.replace(TENANTS)
    before = tags.current
    tags.replace(reversed(TENANTS))
    assert tags.current is before
    tags.replace([*TENANTS, "tn_new"])
    assert tags.current is not before
    assert tags.lookup(CODEC.tenant_tag("tn_new", key_id=1)) == "tn_new"
    tags.replace(TENANTS[1:])
    assert tags.lookup(CODEC.tenant_tag(TENANTS[0], key_id=2)) is None
    assert tags.lookup(CODEC.tenant_tag(TENANTS[1], key_id=2)) == TENANTS[1]


class _PausedBuild:
    """The codec, except that a worker thread's first ``known_tags`` call waits for ``resume``:
    the periodic rebuild is held mid-build while the event loop goes on."""

    def __init__(self, codec: MarkerCodec) -> None:
        self._codec = codec
        self.building, self.resume = threading.Event(), threading.Event()

    def known_tags(self, tenant_ids: list[str]) -> dict[str, KnownTag]:
        if threading.current_thread() is not threading.main_thread() and not self.building.is_set():
            self.building.set()
            assert self.resume.wait(10)
        return self._codec.known_tags(tenant_ids)


def test_a_tenant_indexed_during_a_rebuild_stays_indexed() -> None:
    """The refresh rebuilds the index in a worker thread from tenant ids it read a moment before;
    a tenant whose first request arrives meanwhile is indexed at once on the loop (``add``). The
    rebuild's swap used to drop it: until the next refresh (30 s) a marker of that tenant's in
    another tenant's stream named nobody, and one written without its literal prefix was not
    recognised at all."""
    paused = _PausedBuild(CODEC)
    tags = TagIndex(cast(MarkerCodec, paused))
    tags.replace(TENANTS)
    paused.building.clear()
    rebuild = threading.Thread(target=tags.replace, args=(TENANTS[1:],))  # one tenant gone
    rebuild.start()
    assert paused.building.wait(10)
    tags.add("tn_new")  # its first request, on the loop, while the rebuild is under way
    assert tags.lookup(CODEC.tenant_tag("tn_new", key_id=2)) == "tn_new"
    paused.resume.set()
    rebuild.join(10)
    assert not rebuild.is_alive()
    assert tags.lookup(CODEC.tenant_tag("tn_new", key_id=2)) == "tn_new"
    assert tags.lookup(CODEC.tenant_tag("tn_new", key_id=1)) == "tn_new"
    assert tags.lookup(CODEC.tenant_tag(TENANTS[0], key_id=2)) is None  # the rebuild's removal
    before = tags.current
    tags.replace([*TENANTS[1:], "tn_new"])  # the next refresh finds it in the table: no rebuild
    assert tags.current is before
