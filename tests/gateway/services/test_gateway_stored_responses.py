"""Stored responses (``gateway.services.responses``) on real PostgreSQL and SQLite: the tenant's
alone (another tenant's id answers exactly like one that never existed: same result, same SQL
statement, and -- on PostgreSQL -- the same time), continued by ``previous_response_id``,
deleted by DELETE, by retention and with the tenant, and kept across a new engine (a restart)."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import event, text
from sqlalchemy.exc import InvalidRequestError

from contracts.sql import make_session_factory, session_scope
from gateway.db.models import StoredResponse, Tenant
from gateway.db.session import make_engine, upgrade_database
from gateway.domain import TenantPlan
from gateway.errors import NotFound
from gateway.responses.objects import new_id
from gateway.services import responses as store
from gateway.services.tenants import create_tenant

NOW = datetime(2026, 9, 1, tzinfo=UTC)
TEXT = "answer with odd text: \u0000 nul, \u2028 separator, \U0001f600 emoji, \\u0000 escaped"


def _response(status: str = "completed") -> dict[str, Any]:
    return {
        "id": new_id("resp"),
        "object": "response",
        "status": status,
        "output": [
            {
                "id": new_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": TEXT, "annotations": []}],
            }
        ],
    }


USER = [
    {
        "id": "msg_u",
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "q"}],
    }
]


@pytest.fixture(params=["sqlite_url", "postgres_url"])
def db(request: pytest.FixtureRequest):
    url = request.getfixturevalue(request.param)
    engine = make_engine(url)
    upgrade_database(engine)
    factory = make_session_factory(engine)
    with session_scope(factory) as session:
        tenants = [create_tenant(session, name=n, plan=TenantPlan()).tenant.id for n in "ab"]
    yield url, engine, factory, tenants
    engine.dispose()


def _save(factory, tenant: str, response: dict[str, Any], **kw: Any) -> None:
    with session_scope(factory) as session:
        store.save(
            session,
            tenant_id=tenant,
            response=response,
            history=kw.pop("history", []),
            input_items=USER,
            now=kw.pop("now", NOW),
            **kw,
        )


def _get(factory, tenant: str, response_id: str, now: datetime = NOW):
    with session_scope(factory) as session:
        return store.get(session, tenant_id=tenant, response_id=response_id, now=now)


def test_a_response_is_its_tenants_alone_and_a_foreign_id_is_a_missing_one(db) -> None:
    _, _, factory, (a, b) = db
    response = _response()
    _save(factory, a, response)
    stored = _get(factory, a, response["id"])
    assert stored is not None and stored.response == response  # the odd text survives exactly
    assert stored.input_items == USER
    for asked in (response["id"], new_id("resp"), "resp_short", "x\u0000y", ""):
        assert _get(factory, b, asked) is None
    with session_scope(factory) as session, pytest.raises(NotFound) as foreign:
        store.history(session, tenant_id=b, response_id=response["id"], now=NOW)
    missing = store.not_found(response["id"])
    assert foreign.value.status == missing.status == 404
    assert foreign.value.body() == missing.body()


def test_every_lookup_runs_the_one_statement(db) -> None:
    _, engine, factory, (a, b) = db
    response = _response()
    _save(factory, a, response)
    seen: list[tuple[str, tuple[str, ...]]] = []

    def record(conn, cursor, statement, parameters, context, executemany) -> None:
        kinds = tuple(
            type(p).__name__
            for p in (parameters.values() if isinstance(parameters, dict) else parameters)
        )
        seen.append((statement, kinds))

    event.listen(engine, "before_cursor_execute", record)
    try:
        for asked in (response["id"], new_id("resp"), "not-an-id"):
            _get(factory, b, asked)
    finally:
        event.remove(engine, "before_cursor_execute", record)
    selects = [s for s in seen if s[0].lstrip().upper().startswith("SELECT")]
    assert len(selects) == 3 and len(set(selects)) == 1


def test_the_continuation_is_every_turn_so_far(db) -> None:
    _, _, factory, (a, _) = db
    first = _response()
    _save(factory, a, first)
    with session_scope(factory) as session:
        turn_two = store.history(session, tenant_id=a, response_id=first["id"], now=NOW)
    assert turn_two == [*USER, *first["output"]]
    second = _response()
    _save(factory, a, second, history=turn_two)
    with session_scope(factory) as session:
        stored = store.get(session, tenant_id=a, response_id=second["id"], now=NOW)
        # deleting the first turn does not break the second: each response is whole
        assert store.delete(session, tenant_id=a, response_id=first["id"], now=NOW)
    assert stored is not None and stored.input_items == USER
    assert stored.continuation() == [*USER, *first["output"], *USER, *second["output"]]
    with session_scope(factory) as session:
        again = store.history(session, tenant_id=a, response_id=second["id"], now=NOW)
    assert again == stored.continuation()


def test_delete_is_the_tenants_only(db) -> None:
    _, _, factory, (a, b) = db
    response = _response()
    _save(factory, a, response)
    with session_scope(factory) as session:
        assert not store.delete(session, tenant_id=b, response_id=response["id"], now=NOW)
    assert _get(factory, a, response["id"]) is not None
    with session_scope(factory) as session:
        assert store.delete(session, tenant_id=a, response_id=response["id"], now=NOW)
        assert not store.delete(session, tenant_id=a, response_id=response["id"], now=NOW)
    assert _get(factory, a, response["id"]) is None


def test_retention_hides_then_purges(db) -> None:
    _, _, factory, (a, b) = db
    old, fresh = _response(), _response()
    _save(factory, a, old, retention=timedelta(hours=1))
    _save(factory, b, fresh, retention=timedelta(days=30))
    later = NOW + timedelta(hours=2)
    assert _get(factory, a, old["id"], later) is None  # expired: answered as missing at once
    assert _get(factory, b, fresh["id"], later) is not None
    with session_scope(factory) as session:
        assert store.purge_expired(session, now=later) == 1
        assert store.purge_expired(session, now=later) == 0
        remaining = session.execute(text("SELECT id FROM stored_responses")).scalars().all()
    assert remaining == [fresh["id"]]


def test_a_tenants_responses_go_with_it(db) -> None:
    _, _, factory, (a, b) = db
    for tenant in (a, a, b):
        _save(factory, tenant, _response())
    with session_scope(factory) as session:
        session.delete(session.get(Tenant, a))
    with session_scope(factory) as session:
        owners = session.execute(text("SELECT tenant_id FROM stored_responses")).scalars().all()
        assert owners == [b]
        assert store.forget_tenant(session, tenant_id=b) == 1
        assert session.query(StoredResponse).count() == 0


def test_only_gateway_ids_are_stored(db) -> None:
    _, _, factory, (a, _) = db
    with pytest.raises(ValueError, match="only the gateway's own"):
        _save(factory, a, {**_response(), "id": "resp_engine_chosen"})


def test_the_state_survives_a_new_engine(db) -> None:
    url, engine, factory, (a, _) = db
    response = _response()
    _save(factory, a, response)
    engine.dispose()
    restarted = make_engine(url)
    try:
        stored = _get(make_session_factory(restarted), a, response["id"])
        assert stored is not None and stored.response == response
    finally:
        restarted.dispose()


def test_a_foreign_id_takes_the_time_of_a_missing_one(postgres_url: str) -> None:
    """Interleaved lookups by tenant B of A's ids and of ids that never existed, on PostgreSQL
    with many rows of A: the medians agree within a quarter (plus 0.3 ms for a loaded host)."""
    engine = make_engine(postgres_url)
    upgrade_database(engine)
    factory = make_session_factory(engine)
    with session_scope(factory) as session:
        a, b = (create_tenant(session, name=n, plan=TenantPlan()).tenant.id for n in "ab")
        ids = [new_id("resp") for _ in range(500)]
        for response_id in ids:
            row = {"response": {"id": response_id}, "conversation": [], "input_start": 0}
            session.add(
                StoredResponse(
                    tenant_id=a, id=response_id, created_at=NOW, expires_at=NOW + timedelta(days=1),
                    status="completed", **row,
                )
            )  # fmt: skip
    samples: dict[str, list[float]] = {"foreign": [], "missing": []}
    with session_scope(factory) as session:
        for round_ in range(400):
            for kind in ("foreign", "missing") if round_ % 2 else ("missing", "foreign"):
                asked = ids[round_ % len(ids)] if kind == "foreign" else new_id("resp")
                start = time.perf_counter()
                found = store.get(session, tenant_id=b, response_id=asked, now=NOW)
                samples[kind].append(time.perf_counter() - start)
                assert found is None
    engine.dispose()
    foreign, missing = (statistics.median(samples[k][50:]) for k in ("foreign", "missing"))
    print(f"foreign {foreign * 1e6:.0f} us, missing {missing * 1e6:.0f} us")
    assert abs(foreign - missing) <= 0.25 * max(foreign, missing) + 0.0003, (foreign, missing)


async def test_the_purge_goes_on_after_a_failure_that_is_no_database_error(
    db, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The purge loop caught only database errors: anything else (the pool giving up on a
    connection whose checkout ping failed twice: SQLAlchemy's InvalidRequestError) ended it, and
    expired responses were kept for as long as the gateway ran."""
    _, _, factory, (a, _) = db
    expired = _response()
    _save(factory, a, expired, retention=timedelta(hours=1))  # stored at NOW: long expired
    purge_batch, calls, purged = store._purge_batch, [], threading.Event()

    def failing_once(session: Any) -> int:
        if sum(calls):  # a round after the one that purged: that one's transaction committed
            purged.set()
        if not calls:
            calls.append(0)
            raise InvalidRequestError("This connection is closed")
        calls.append(purge_batch(session))
        return calls[-1]

    monkeypatch.setattr(store, "_purge_batch", failing_once)
    task = asyncio.create_task(store.purge_loop(factory, interval_s=0.01))
    try:
        assert await asyncio.to_thread(purged.wait, 10), task  # a later round purged it
        assert not task.done()
    finally:
        task.cancel()
    assert calls[:2] == [0, 1] and _stored_ids(factory) == []


def _stored_ids(factory) -> list[str]:
    with session_scope(factory) as session:
        return list(session.execute(text("SELECT id FROM stored_responses")).scalars())
