"""Audit rows against a real PostgreSQL: across an outage (a server behind a cuttable link: a flush
whose connection broke may still have committed, and its retry must not write those rows again,
found under load), with a row the database refuses (set aside, the rest land: one bad row used to
stop every audit write of a replica), at a shutdown while the database is unreachable (the rows
are spooled locally and written by the next start), and into a server that froze mid-flush (cut
within the database bound). Each through both of the writer's paths: a session on a worker thread,
and the writer's own connection on the event loop (``gateway.db.link``: the gateway's usual flush
on PostgreSQL)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, replace

import pytest
from sqlalchemy import Engine, event, select
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

from bench.fault_stack import TcpLink
from contracts.spool import Spool
from contracts.sql import is_outage, make_session_factory, session_scope
from gateway.db.link import Link
from gateway.db.models import RequestAudit
from gateway.db.session import make_engine, upgrade_database
from gateway.services.audit import AuditWriter
from tests.gateway.audit_rows import audit_record

VIA = pytest.mark.parametrize("via", ["session", "link"])


def _writer(engine: Engine, via: str, **kwargs: object) -> AuditWriter:
    """A writer on ``engine``: through sessions only, or with its own connection too (``link``)."""
    link = Link.of(engine, timeout_s=2.0) if via == "link" else None
    return AuditWriter(
        session_factory=make_session_factory(engine),
        flush_interval_s=60,
        link=link,
        **kwargs,  # type: ignore[arg-type]
    )


@VIA
async def test_a_flush_that_committed_before_its_connection_broke_is_not_written_twice(
    postgres_url: str, via: str
) -> None:
    direct = make_engine(postgres_url)
    upgrade_database(direct)
    url = make_url(postgres_url)
    assert url.host is not None and url.port is not None
    link = TcpLink(url.host, url.port)
    linked = make_engine(url.set(port=link.port).render_as_string(hide_password=False))
    writer = _writer(linked, via)
    try:
        writer.record(audit_record("landed"))
        link.cut()
        with pytest.raises(Exception) as raised:
            await writer.flush()
        assert is_outage(raised.value), repr(raised.value)
        # That flush's commit landed after all (only its answer was lost): the row is there.
        with session_scope(make_session_factory(direct)) as session:
            session.add(RequestAudit(**asdict(audit_record("landed"))))
        writer.record(audit_record("during"))
        link.restore()
        await writer.flush()
        with session_scope(make_session_factory(direct)) as session:
            ids = sorted(session.scalars(select(RequestAudit.request_id)))
        assert ids == ["during", "landed"]
    finally:
        await writer.close()
        link.close()
        linked.dispose()
        direct.dispose()


# -- one row the database refuses must not stop the others ---------------------------------------


def _ids(factory) -> list[str]:
    with session_scope(factory) as session:
        return sorted(session.scalars(select(RequestAudit.request_id)))


@VIA
async def test_a_row_the_database_refuses_is_set_aside_and_the_rest_land(
    postgres_url: str, caplog: pytest.LogCaptureFixture, via: str
) -> None:
    """An engine that reports 2**40 completion tokens (PostgreSQL's integer column refuses it):
    the batch is split until that row stands alone; it is counted and logged by request id; the
    other 99 land in the same flush; the writer keeps writing afterwards."""
    engine = make_engine(postgres_url)
    upgrade_database(engine)
    factory = make_session_factory(engine)
    aside: list[int] = []
    writer = _writer(engine, via, on_set_aside=lambda: aside.append(1))
    try:
        for n in range(100):
            record = audit_record(f"row{n:03d}")
            if n == 37:
                record = replace(record, completion_tokens=2**40)
            writer.record(record)
        await writer.flush()
        assert writer.pending == 0
        assert _ids(factory) == [f"row{n:03d}" for n in range(100) if n != 37]
        assert aside == [1]
        assert "audit row of request row037" in caplog.text and "set aside" in caplog.text
        writer.record(audit_record("after"))
        await writer.flush()
        assert "after" in _ids(factory)
    finally:
        await writer.close()
        engine.dispose()


@VIA
async def test_text_postgresql_refuses_is_neutralised_when_recorded(
    postgres_url: str, via: str
) -> None:
    """A NUL or a lone surrogate in any text field (an engine's error code, say) and an error
    code longer than its column: stored with U+FFFD and cut, not refused."""
    engine = make_engine(postgres_url)
    upgrade_database(engine)
    factory = make_session_factory(engine)
    writer = _writer(engine, via)
    try:
        writer.record(audit_record("nul", model="tiny\x00", error_code="x\ud800" + "y" * 99))
        await writer.flush()
        with session_scope(factory) as session:
            row = session.scalars(select(RequestAudit)).one()
        assert row.model == "tiny\ufffd"
        assert row.error_code == "x\ufffd" + "y" * 62  # the column holds 64
    finally:
        await writer.close()
        engine.dispose()


@VIA
async def test_rows_pending_at_shutdown_are_spooled_and_written_by_the_next_start(
    postgres_url: str, tmp_path, via: str
) -> None:
    """PostgreSQL unreachable when the gateway stops: the final flush fails, the rows go to the
    local spool (not lost), and the next start writes them exactly once."""
    direct = make_engine(postgres_url)
    upgrade_database(direct)
    url = make_url(postgres_url)
    assert url.host is not None and url.port is not None
    link = TcpLink(url.host, url.port)
    linked = make_engine(url.set(port=link.port).render_as_string(hide_password=False))
    spool = Spool(tmp_path / "spool", kind="audit")
    writer = _writer(linked, via, spool=spool)
    try:
        for name in ("a", "b", "c"):
            writer.record(audit_record(name))
        link.cut()
        await writer.close()  # the final flush fails: spooled
        assert writer.pending == 0 and len(spool.pending()) == 1
        link.restore()
        restarted = AuditWriter(
            session_factory=make_session_factory(direct), flush_interval_s=60, spool=spool
        )
        await restarted.drain_spool()
        await restarted.drain_spool()  # nothing left: no second copy
        assert _ids(make_session_factory(direct)) == ["a", "b", "c"]
        assert spool.pending() == []
    finally:
        link.close()
        linked.dispose()
        direct.dispose()


async def test_a_flush_into_a_database_that_froze_is_cut_within_the_bound(
    postgres_url: str,
) -> None:
    """The flush's COPY runs on the driver's cursor, below the statement events that arm the
    database watchdog, so it arms it itself. The server stops answering once the connection is
    lent (its checkout ping answered): the flush fails as an outage within the bound instead of
    blocking its worker thread for ever, the row stays pending, and once the server answers
    again the next flush writes it, once."""
    with _freezable(postgres_url) as (direct, link, linked, backstop):
        frozen: list[bool] = []

        def freeze_once_lent(*_args: object) -> None:  # after the watchdog's checkout ping
            if not frozen:
                frozen.append(True)
                link.freeze()

        event.listen(linked, "checkout", freeze_once_lent)
        writer = AuditWriter(session_factory=make_session_factory(linked), flush_interval_s=60)
        writer.record(audit_record("frozen"))
        backstop.start()
        started = time.monotonic()
        with pytest.raises(OperationalError) as raised:
            await writer.flush()
        waited = time.monotonic() - started
        assert is_outage(raised.value)
        assert frozen and waited < BOUND_S + 2, waited
        assert writer.pending == 1
        link.thaw()
        await writer.flush()
        assert _ids(make_session_factory(direct)) == ["frozen"]


async def test_a_flush_on_the_writers_link_into_a_database_that_froze_is_cut_within_the_bound(
    postgres_url: str,
) -> None:
    """The writer's own connection (the usual flush on PostgreSQL, ``gateway.db.link``): the
    server stops answering once the link is connected; the flush fails as an outage within the
    bound (the link's timer cuts its socket), the row stays pending, and once the server answers
    again the next flush writes it, once (through a session: the cut flush may have landed)."""
    with _freezable(postgres_url) as (direct, tcp, linked, backstop):
        writer = AuditWriter(
            session_factory=make_session_factory(linked),
            flush_interval_s=60,
            link=Link.of(linked, timeout_s=BOUND_S),
        )
        try:
            writer.record(audit_record("before"))
            await writer.flush()  # the link is connected
            tcp.freeze()
            writer.record(audit_record("frozen"))
            backstop.start()
            started = time.monotonic()
            with pytest.raises(Exception) as raised:
                await writer.flush()
            waited = time.monotonic() - started
            assert is_outage(raised.value), repr(raised.value)
            assert waited < BOUND_S + 2, waited
            assert writer.pending == 1
            tcp.thaw()
            await writer.flush()
            assert _ids(make_session_factory(direct)) == ["before", "frozen"]
        finally:
            await writer.close()


BOUND_S = 1.0  # the database timeout of the frozen-server tests


@contextlib.contextmanager
def _freezable(postgres_url: str) -> Iterator[tuple[Engine, TcpLink, Engine, threading.Timer]]:
    """A migrated database (``direct``), a TCP link to it that a test can freeze, an engine
    through that link bounded by ``BOUND_S``, and a backstop the test starts before its frozen
    flush: it cuts the link ``BOUND_S + 5`` s later, so an unbounded flush fails the test, late,
    instead of hanging it."""
    direct = make_engine(postgres_url)
    upgrade_database(direct)
    url = make_url(postgres_url)
    assert url.host is not None and url.port is not None
    link = TcpLink(url.host, url.port)
    linked = make_engine(
        url.set(port=link.port).render_as_string(hide_password=False), timeout_s=BOUND_S
    )
    backstop = threading.Timer(BOUND_S + 5, link.cut)
    try:
        yield direct, link, linked, backstop
    finally:
        backstop.cancel()
        link.close()
        linked.dispose()
        direct.dispose()
