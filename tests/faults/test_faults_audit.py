"""Audit rows across a PostgreSQL outage, with a real server behind a cuttable link: a flush whose
connection broke may still have committed, and its retry must not write those rows again (found
under load: two rows for one request after the database came back)."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime

import pytest
from sqlalchemy import select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from bench.fault_stack import TcpLink
from gateway.db.models import RequestAudit
from gateway.db.session import make_engine, make_session_factory, session_scope, upgrade_database
from gateway.services.audit import AuditRecord, AuditWriter


def _record(request_id: str) -> AuditRecord:
    return AuditRecord(
        request_id=request_id,
        tenant_id="tn_1",
        key_prefix=None,
        endpoint="chat",
        model="m",
        engine="e",
        stream=True,
        prompt_tokens=10,
        max_tokens=4,
        completion_tokens=4,
        outcome="completed",
        http_status=200,
        error_code=None,
        handoff_outcome=None,
        reserved_tokens=None,
        transferred_tokens=None,
        started_at=datetime.now(UTC),
        ttft_ms=1.0,
        duration_ms=2.0,
    )


async def test_a_flush_that_committed_before_its_connection_broke_is_not_written_twice(
    postgres_url: str,
) -> None:
    direct = make_engine(postgres_url)
    upgrade_database(direct)
    url = make_url(postgres_url)
    assert url.host is not None and url.port is not None
    link = TcpLink(url.host, url.port)
    linked = make_engine(url.set(port=link.port).render_as_string(hide_password=False))
    writer = AuditWriter(session_factory=make_session_factory(linked), flush_interval_s=60)
    try:
        writer.record(_record("landed"))
        link.cut()
        with pytest.raises(OperationalError):
            await writer.flush()
        # That flush's commit landed after all (only its answer was lost): the row is there.
        with session_scope(make_session_factory(direct)) as session:
            session.add(RequestAudit(**asdict(_record("landed"))))
        writer.record(_record("during"))
        link.restore()
        await writer.flush()
        with session_scope(make_session_factory(direct)) as session:
            ids = sorted(session.scalars(select(RequestAudit.request_id)))
        assert ids == ["during", "landed"]
    finally:
        link.close()
        linked.dispose()
        direct.dispose()
