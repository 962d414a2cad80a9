"""Engine controls under two writers at once, on PostgreSQL (production's database).

A CI run met it: the quarantine writer, behind a slow database, was still creating a new engine's
``engine_controls`` row when an admin's clear created it too; the clear failed on the primary key
and the admin got a 500. Here the two writers are made to overlap exactly: the clear has looked
for the row and not committed when the quarantine runs in a second session.
"""

from __future__ import annotations

import threading
import time

from sqlalchemy import text

from contracts.sql import make_session_factory, session_scope
from gateway.db.session import make_engine, upgrade_database
from gateway.services import engines as engine_service

ENGINE = "vllm"


def _waiting_on_a_lock(sessions) -> bool:
    query = text(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    with session_scope(sessions) as session:
        return bool(session.scalar(query))


def test_a_clear_and_a_quarantine_creating_one_row_both_land(postgres_url: str) -> None:
    engine = make_engine(postgres_url)
    upgrade_database(engine)
    sessions = make_session_factory(engine)
    errors: list[BaseException] = []
    writer_done = threading.Event()

    def quarantine() -> None:
        try:
            with session_scope(sessions) as session:
                engine_service.quarantine(session, name=ENGINE, reason="cross-tenant marker")
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)
        finally:
            writer_done.set()

    clearing = sessions()
    try:
        cleared = engine_service.clear_quarantine(clearing, name=ENGINE)  # looked, not committed
        writer = threading.Thread(target=quarantine)
        writer.start()
        # The writer either finished (it found no row either and created its own) or waits for
        # this unit of work to commit: go on when one of the two is observable.
        deadline = time.monotonic() + 30
        while not writer_done.is_set() and not _waiting_on_a_lock(sessions):
            assert time.monotonic() < deadline, "the writer neither finished nor waited"
            writer_done.wait(0.01)
        clearing.commit()
    finally:
        clearing.close()
    writer.join(timeout=30)
    assert not writer.is_alive()
    assert errors == []
    assert cleared.quarantine_reason is None
    with session_scope(sessions) as session:  # the later writer's decision stands
        assert engine_service.controls(session)[ENGINE].quarantine_reason == "cross-tenant marker"
    engine.dispose()
