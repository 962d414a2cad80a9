"""The database watchdog (``gateway.db.watchdog``) on a real PostgreSQL that stops answering after
lending a connection (a link that holds every byte: the server's kernel still acknowledges)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError

from bench.fault_stack import TcpLink
from contracts.sql import is_outage, make_session_factory, session_scope
from gateway.db.session import make_engine

BOUND_S = 1.0


@pytest.fixture
def freezing(postgres_url: str) -> Iterator[tuple[Engine, list[bool]]]:
    """An engine bounded by ``BOUND_S`` whose link freezes once, right after the next checkout
    (its ping answered); the list says whether it froze."""
    url = make_url(postgres_url)
    assert url.host is not None and url.port is not None
    link = TcpLink(url.host, url.port)
    engine = make_engine(
        url.set(port=link.port).render_as_string(hide_password=False), timeout_s=BOUND_S
    )
    frozen: list[bool] = []

    def freeze_once_lent(*_args: object) -> None:  # runs after the watchdog's checkout ping
        if not frozen:
            frozen.append(True)
            link.freeze()

    event.listen(engine, "checkout", freeze_once_lent)
    try:
        yield engine, frozen
    finally:
        link.close()
        engine.dispose()


def test_a_statement_cut_in_a_transaction_is_an_outage_within_the_bound(
    freezing: tuple[Engine, list[bool]],
) -> None:
    """The statement is cut within the bound and the unit of work fails as an outage. Its
    rollback runs on the connection the cut invalidated; the watchdog's rollback listener used to
    ask that connection for its driver connection, which raised ``PendingRollbackError`` in place
    of the outage: callers that retry outages (the audit writer) took it for a refused row."""
    engine, frozen = freezing
    started = time.monotonic()
    with pytest.raises(DBAPIError) as raised, session_scope(make_session_factory(engine)) as s:
        s.execute(text("SELECT 1"))
    waited = time.monotonic() - started
    assert frozen
    assert is_outage(raised.value), repr(raised.value)
    assert waited < BOUND_S + 1, waited
