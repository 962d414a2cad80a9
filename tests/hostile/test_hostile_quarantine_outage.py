"""A leak caught while PostgreSQL is down is still quarantined everywhere and still recorded.

Attacker: an engine that mixes customers up (the ``Follower`` stand-in for a provider, told to
leak a marker another tenant's request carried), at a moment PostgreSQL refuses connections.
The gateway used to write the quarantine and the finding to PostgreSQL before anything else: with
the database down both failed, the engine stayed in routing on every replica, the finding was
lost, and the tenant was told "The event has been recorded".

Proves, with two gateway replicas on a real PostgreSQL (behind a link the test cuts) and a real
Redis: the cut answer claims nothing about recording; the replica that caught the leak stops
routing to the engine at once, and the other replica within a second (Redis, not PostgreSQL:
its reload from the database is 30 s away); the finding and the quarantine are kept on local
disk through the replica's shutdown, and a replica started on the same data directory writes
both to PostgreSQL once it answers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hostile_harness import (
    FOLLOWER_MODEL,
    Follower,
    ServedGateway,
    follower_engine,
    gateway_settings,
    served_follower,
    served_gateway,
)
from sqlalchemy import select
from sqlalchemy.engine import make_url

from bench.fault_stack import TcpLink
from canary.findings import CanaryFinding
from contracts.sql import make_session_factory, session_scope
from gateway.db.models import EngineControl
from gateway.db.session import make_engine


def _ask(gw: ServedGateway, key: str, text: str = "repeat: hi") -> httpx.Response:
    body = {"model": FOLLOWER_MODEL, "messages": [{"role": "user", "content": text}]}
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def _until(check: Callable[[], bool], timeout_s: float, what: str) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, f"{what}: not within {timeout_s} s"
        time.sleep(0.02)
    return time.monotonic() - started


def _rows(url: str) -> tuple[list[CanaryFinding], list[EngineControl]]:
    engine = make_engine(url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            findings = list(session.scalars(select(CanaryFinding)))
            controls = list(session.scalars(select(EngineControl)))
        return findings, controls
    finally:
        engine.dispose()


@pytest.fixture
def follower() -> Iterator[Follower]:
    with served_follower() as f:
        yield f


def test_a_leak_during_a_postgres_outage_is_quarantined_everywhere_and_recorded_later(
    postgres_url: str, redis_url: str, follower: Follower, tmp_path: Path
) -> None:
    url = make_url(postgres_url)
    assert url.host is not None and url.port is not None
    link = TcpLink(url.host, url.port)
    linked = url.set(port=link.port).render_as_string(hide_password=False)
    options: dict[str, Any] = {
        "engines": [follower_engine(follower.url)],
        "redis_url": redis_url,
        "data_dir": tmp_path,
        "auth_cache_ttl_s": 300.0,  # keys checked before the outage stay valid through it
        "poll_interval_s": 30.0,  # no reload from the database during the test
    }
    settings = gateway_settings(linked, follower.url, **options)
    try:
        with served_gateway(settings) as second:
            with served_gateway(settings) as first:
                _, victim = first.create_tenant("victim", canary_sample_rate=1.0)
                _, observer = first.create_tenant("observer")
                _, bystander = first.create_tenant("bystander")
                for gw in (first, second):
                    for key in (victim, observer, bystander):
                        assert _ask(gw, key).status_code == 200
                link.cut()  # PostgreSQL refuses from here on
                follower.leak = True
                cut = _ask(first, observer, "anything")
                assert (cut.status_code, cut.json()["error"]["code"]) == (
                    502,
                    "isolation_violation",
                )
                assert "recorded" not in cut.text
                follower.leak = False
                refused = _ask(first, bystander)
                assert refused.json()["error"]["code"] == "no_healthy_engine", refused.text
                took = _until(
                    lambda: _ask(second, bystander).status_code == 503, 2.0, "the other replica"
                )
                assert took < 1.0, took
                assert list((tmp_path / "spool").rglob("findings-*.json"))
            # The replica that caught it has stopped, the database still down: kept on disk.
            assert list((tmp_path / "spool").rglob("findings-*.json"))
            assert list((tmp_path / "spool").rglob("quarantine-*.json"))
        link.restore()
        with served_gateway(settings):  # a new replica on the same data directory
            _until(lambda: bool(_rows(postgres_url)[0]), 10.0, "the spooled finding written")
            _until(lambda: bool(_rows(postgres_url)[1]), 10.0, "the spooled quarantine written")
        [finding], [control] = _rows(postgres_url)
        assert (finding.kind, finding.severity, finding.action) == (
            "cross_tenant",
            "critical",
            "cut_quarantined",
        )
        assert control.engine_name == "follower" and control.quarantined_at is not None
        assert not list((tmp_path / "spool").rglob("*.json"))
    finally:
        link.close()
