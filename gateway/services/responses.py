"""Stored responses: the Responses API's state, the tenant's alone.

Lifecycle of a stored response::

    save          at the request's single exit, only for ``store`` (the default): the Response
                  as the client got it and the conversation up to this turn, expiring after the
                  retention (``expires_at``)
    get/history   ``GET /v1/responses/{id}``, ``input_items``, and ``previous_response_id``
    delete        ``DELETE /v1/responses/{id}``; an expired row answers as deleted before the purge
    purge_expired in batches, by ``purge_loop`` (a task of the gateway's lifespan)
    (the tenant)  deleting a tenant deletes its rows (foreign key ``ON DELETE CASCADE``);
                  ``forget_tenant`` does it without deleting the tenant: an operator's erasure
                  (``operator.erase_responses``: the admin API and the console; the CLI)

No oracle: every lookup runs ONE statement of one shape, ``WHERE tenant_id = :t AND id = :id AND
expires_at > :now``, on the primary key (tenant_id, id). Another tenant's id finds nothing under
this tenant's part of the index -- no row is read and discarded -- exactly like an id that never
existed; an id that is not even of the gateway's form is looked up as ``UNKNOWN_ID`` (well formed,
never issued: not hex), so it runs the same statement too, and every miss answers ``not_found``,
one body built from the id the client sent. Services take a session and keyword-only arguments;
the caller owns the transaction (``contracts.sql.run_in_session``). Nothing here is audited: the
audit stays content-free.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete as sql_delete
from sqlalchemy import select, tuple_
from sqlalchemy.orm import Session, sessionmaker

from contracts import grid
from contracts.sql import DATABASE_ERRORS, run_in_session, utcnow
from gateway.db.models import StoredResponse
from gateway.errors import NotFound
from gateway.responses.objects import ID_HEX, is_response_id

UNKNOWN_ID = "resp_" + "z" * ID_HEX  # of the stored form, never issued (not hex)
DEFAULT_RETENTION = timedelta(days=30)
PURGE_BATCH = 500
PURGE_INTERVAL_S = 600.0
log = logging.getLogger("kvguard.gateway.responses")


@dataclass(frozen=True, slots=True)
class Stored:
    response: dict[str, Any] = field(repr=False)
    conversation: list[dict[str, Any]] = field(repr=False)
    input_start: int

    @property
    def input_items(self) -> list[dict[str, Any]]:
        """This turn's input items (``GET .../input_items``)."""
        return self.conversation[self.input_start :]

    def continuation(self) -> list[dict[str, Any]]:
        """The items a request continuing this response starts from: every input so far and
        this response's output."""
        return [*self.conversation, *self.response.get("output", [])]


def lookup_id(response_id: str) -> str:
    """The id a lookup runs with: the client's when of the gateway's form, else UNKNOWN_ID."""
    return response_id if is_response_id(response_id) else UNKNOWN_ID


def not_found(response_id: str) -> NotFound:
    """The one answer to every id not found for this tenant (missing, another's, expired)."""
    shown = response_id[:128]
    return NotFound(f"Response with id '{shown}' not found.", param="response_id")


def get(session: Session, *, tenant_id: str, response_id: str, now: datetime) -> Stored | None:
    row = session.execute(
        select(
            StoredResponse.response, StoredResponse.conversation, StoredResponse.input_start
        ).where(
            StoredResponse.tenant_id == tenant_id,
            StoredResponse.id == lookup_id(response_id),
            StoredResponse.expires_at > now,
        )
    ).first()
    return None if row is None else Stored(row[0], row[1], row[2])


def history(
    session: Session, *, tenant_id: str, response_id: str, now: datetime
) -> list[dict[str, Any]]:
    """The conversation a ``previous_response_id`` continues, or ``not_found``."""
    stored = get(session, tenant_id=tenant_id, response_id=response_id, now=now)
    if stored is None:
        raise not_found(response_id)
    return stored.continuation()


def save(
    session: Session,
    *,
    tenant_id: str,
    response: dict[str, Any],
    history: list[dict[str, Any]],
    input_items: list[dict[str, Any]],
    now: datetime,
    retention: timedelta = DEFAULT_RETENTION,
) -> None:
    """Keep ``response`` (its ``id`` issued by the gateway) with the conversation before it."""
    response_id = response["id"]
    if not is_response_id(response_id):
        raise ValueError("only the gateway's own response ids are stored")
    session.add(
        StoredResponse(
            tenant_id=tenant_id,
            id=response_id,
            created_at=now,
            expires_at=now + retention,
            status=str(response.get("status", "completed"))[:16],
            response=response,
            conversation=[*history, *input_items],
            input_start=len(history),
        )
    )


def delete(session: Session, *, tenant_id: str, response_id: str, now: datetime) -> bool:
    """Delete one of the tenant's responses; False when there is none (answer ``not_found``)."""
    result = session.execute(
        sql_delete(StoredResponse).where(
            StoredResponse.tenant_id == tenant_id,
            StoredResponse.id == lookup_id(response_id),
            StoredResponse.expires_at > now,
        )
    )
    return bool(getattr(result, "rowcount", 0))


def purge_expired(session: Session, *, now: datetime, limit: int = PURGE_BATCH) -> int:
    """Delete up to ``limit`` expired responses (of any tenant); how many went."""
    keys = session.execute(
        select(StoredResponse.tenant_id, StoredResponse.id)
        .where(StoredResponse.expires_at <= now)
        .limit(limit)
    ).all()
    if keys:
        pair = tuple_(StoredResponse.tenant_id, StoredResponse.id)
        session.execute(sql_delete(StoredResponse).where(pair.in_([tuple(k) for k in keys])))
    return len(keys)


async def purge_loop(
    sessions: sessionmaker[Session], *, interval_s: float = PURGE_INTERVAL_S
) -> None:
    """Purge expired responses in batches, then again every ``interval_s`` (a task of the
    gateway's lifespan; replicas that purge at once delete disjoint or no rows)."""
    while True:
        try:
            while await run_in_session(sessions, _purge_batch) == PURGE_BATCH:
                pass
        except DATABASE_ERRORS as exc:  # an outage, or a refusal: the next round tries again
            log.warning("stored responses not purged yet: %s", type(exc).__name__)
        except Exception:  # anything else (the pool giving up on a connection): the same
            log.exception("stored responses not purged yet")
        await grid.sleep(interval_s)


def _purge_batch(session: Session) -> int:
    return purge_expired(session, now=utcnow())


def forget_tenant(session: Session, *, tenant_id: str) -> int:
    """Delete every stored response of one tenant; how many went."""
    result = session.execute(
        sql_delete(StoredResponse).where(StoredResponse.tenant_id == tenant_id)
    )
    return int(getattr(result, "rowcount", 0))
