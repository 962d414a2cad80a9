"""Tenant API keys: format, issue (shown once), revoke, authenticate.

A key reads ``kvg_<prefix>_<secret>``: 12 hex characters of prefix (the row lookup, safe to show
and log) and 64 hex characters (256 bits) of secret. Only SHA-256 of the secret is stored: with
256 random bits there is nothing to brute-force, so no pepper (and no second secret to manage)
is needed. Verification compares digests in constant time.

Lifecycle of a key: issued -> (used: ``last_used_at`` refreshed, throttled) -> revoked or expired.
Revocation and expiry are timestamps; a key with either in the past never authenticates again.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, cast

import psycopg
from sqlalchemy import Engine, Table, any_, bindparam, select, update
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.orm import Session

from contracts.sql import utcnow
from gateway.db.link import Link
from gateway.db.models import ApiKey, Tenant
from gateway.domain import Principal, TenantPlan
from gateway.errors import NotFound
from gateway.lifecycle import TenantStatus

KEY_SCHEME = "kvg"
PREFIX_HEX = 12
SECRET_HEX = 64
RENEW_CHUNK = 500  # key ids per renewal statement (bounded statement size)
_KEY_RE = re.compile(rf"{KEY_SCHEME}_([0-9a-f]{{{PREFIX_HEX}}})_([0-9a-f]{{{SECRET_HEX}}})")


@dataclass(frozen=True, slots=True)
class ParsedKey:
    prefix: str
    secret: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A freshly issued key: the only moment the full key exists outside the client."""

    key: str = field(repr=False)
    prefix: str
    tenant_id: str
    expires_at: datetime | None


class AuthFailure(StrEnum):
    MALFORMED = "malformed"
    UNKNOWN = "unknown"  # no such prefix, or the secret does not match: told apart nowhere
    REVOKED = "revoked"
    EXPIRED = "expired"
    TENANT_DISABLED = "tenant_disabled"


def parse_key(token: str) -> ParsedKey | None:
    match = _KEY_RE.fullmatch(token)
    if match is None:
        return None
    return ParsedKey(prefix=match.group(1), secret=match.group(2))


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode("ascii")).hexdigest()


def looks_like_tenant_key(token: str) -> bool:
    return token.startswith(f"{KEY_SCHEME}_")


def _new_key() -> tuple[str, ParsedKey]:
    parsed = ParsedKey(prefix=secrets.token_hex(PREFIX_HEX // 2), secret=secrets.token_hex(32))
    return f"{KEY_SCHEME}_{parsed.prefix}_{parsed.secret}", parsed


def issue_key(
    session: Session, *, tenant_id: str, name: str | None = None, expires_at: datetime | None = None
) -> IssuedKey:
    """Store a new key's prefix and hash; the returned ``IssuedKey.key`` is never stored."""
    for _ in range(5):  # a 48-bit prefix collision is astronomically rare; retry regardless
        key, parsed = _new_key()
        if session.scalar(select(ApiKey.id).where(ApiKey.prefix == parsed.prefix)) is not None:
            continue
        row = ApiKey(
            tenant_id=tenant_id,
            prefix=parsed.prefix,
            secret_hash=hash_secret(parsed.secret),
            name=name,
            expires_at=expires_at,
        )
        session.add(row)
        session.flush()
        return IssuedKey(key=key, prefix=parsed.prefix, tenant_id=tenant_id, expires_at=expires_at)
    raise RuntimeError("could not allocate a unique key prefix")


def revoke_key(session: Session, *, prefix: str, now: datetime | None = None) -> ApiKey:
    row = session.scalar(select(ApiKey).where(ApiKey.prefix == prefix))
    if row is None:
        raise NotFound(f"no API key with prefix '{prefix}'", code="key_not_found")
    if row.revoked_at is None:
        row.revoked_at = now or utcnow()
    return row


def list_keys(session: Session, *, tenant_id: str) -> list[ApiKey]:
    query = select(ApiKey).where(ApiKey.tenant_id == tenant_id).order_by(ApiKey.id)
    return list(session.scalars(query))


# What deciding a key needs, one row per key (Core: no ORM objects; a renewal reads every key in
# use, every half ttl, so at 10,000 tenants loading entities was most of its cost)
_KEY_ROW = select(
    ApiKey.id.label("key_id"),
    ApiKey.prefix,
    ApiKey.secret_hash,
    ApiKey.revoked_at,
    ApiKey.expires_at,
    ApiKey.last_used_at,
    Tenant.id.label("tenant_id"),
    Tenant.name.label("tenant_name"),
    Tenant.status,
    Tenant.requests_per_minute,
    Tenant.tokens_per_minute,
    Tenant.max_concurrency,
    Tenant.max_context_tokens,
    Tenant.synthetic,
    Tenant.canary_sample_rate,
).join(Tenant, Tenant.id == ApiKey.tenant_id)


def authenticate(session: Session, *, token: str, now: datetime) -> Principal | AuthFailure:
    """The tenant behind ``token``, or why not. Unknown prefix and wrong secret look the same."""
    parsed = parse_key(token)
    if parsed is None:
        return AuthFailure.MALFORMED
    return _decided(
        parsed, session.execute(_KEY_ROW.where(ApiKey.prefix == parsed.prefix)).first(), now
    )


# ``authenticate``'s read for a ``Link`` (PostgreSQL, no ORM): the same row, by its prefix
_BY_PREFIX = str(
    _KEY_ROW.where(ApiKey.prefix == bindparam("prefix")).compile(dialect=PGDialect_psycopg())
)


async def authenticate_over(link: Link, *, token: str, now: datetime) -> Principal | AuthFailure:
    """``authenticate`` on a replica's own PostgreSQL connection (``gateway.db.link``): the same
    verdict, read on the event loop in one round trip, with no session or thread."""
    parsed = parse_key(token)
    if parsed is None:
        return AuthFailure.MALFORMED
    rows = await link.rows(_BY_PREFIX, {"prefix": parsed.prefix})
    return _decided(parsed, rows[0] if rows else None, now)


class LookupLinks:
    """The request path's key lookups on PostgreSQL (``authenticate_over``), on links of their
    own: ``per_lane`` for each of the auth cache's lanes (``gateway.services.auth_cache``: keys
    this replica verified before, and the rest), as many as a lane lets run at once. A lookup
    takes an idle link of its lane, so a slow statement holds up no other key's lookup, and a
    stream of guessed secrets under a real prefix never takes a connection from a tenant's own
    key."""

    def __init__(self, lanes: dict[bool, list[Link]]) -> None:
        self._links = [link for links in lanes.values() for link in links]
        self._idle: dict[bool, asyncio.Queue[Link]] = {}
        for verified_before, links in lanes.items():
            idle = self._idle[verified_before] = asyncio.Queue()
            for link in links:
                idle.put_nowait(link)

    @classmethod
    def of(cls, engine: Engine, *, timeout_s: float, per_lane: int) -> LookupLinks | None:
        """Links to the database of ``engine``; None unless it is PostgreSQL."""
        if engine.dialect.name != "postgresql":
            return None
        return cls(
            {
                lane: [cast(Link, Link.of(engine, timeout_s=timeout_s)) for _ in range(per_lane)]
                for lane in (True, False)
            }
        )

    async def authenticate(
        self, token: str, *, now: datetime, verified_before: bool
    ) -> Principal | AuthFailure:
        """``authenticate_over`` on an idle link of the token's lane (waiting for one if the
        lane's are all busy)."""
        idle = self._idle[verified_before]
        link = await idle.get()
        try:
            return await authenticate_over(link, token=token, now=now)
        finally:
            idle.put_nowait(link)

    async def open(self) -> None:
        """Connect every link now: a lookup, on a request's path, never waits for a connection
        to be made (one made anew after a break excepted)."""
        await asyncio.gather(*(link.connect() for link in self._links))

    async def close(self) -> None:
        for link in self._links:
            await link.close()


def _decided(parsed: ParsedKey, row: Any, now: datetime) -> Principal | AuthFailure:
    """The verdict on a token whose prefix read ``row`` (a ``_KEY_ROW``, or None: no such key);
    an unknown prefix and a wrong secret look the same, and cost the same hash."""
    if row is None:
        hmac.compare_digest(hash_secret(parsed.secret), "0" * 64)  # same work as a real miss
        return AuthFailure.UNKNOWN
    if not hmac.compare_digest(hash_secret(parsed.secret), row.secret_hash):
        return AuthFailure.UNKNOWN
    return _verdict(row, now)


def renew(
    session: Session, *, key_ids: list[int], now: datetime
) -> dict[int, Principal | AuthFailure]:
    """What ``authenticate`` would say now about keys whose secrets were checked before, by id (a
    key's secret never changes): the replica's renewal of the keys it trusts
    (``gateway.services.auth_cache``). A key the database no longer holds is left out."""
    verdicts: dict[int, Principal | AuthFailure] = {}
    for start in range(0, len(key_ids), RENEW_CHUNK):
        chunk = key_ids[start : start + RENEW_CHUNK]
        for row in session.execute(_KEY_ROW.where(ApiKey.id.in_(chunk))):
            verdicts[row.key_id] = _verdict(row, now)
    return verdicts


# ``renew``'s read for a ``Link`` (PostgreSQL, no ORM): the same row, the chunk's ids as one array
_RENEW_BY_IDS = str(
    _KEY_ROW.where(ApiKey.id == any_(bindparam("ids"))).compile(dialect=PGDialect_psycopg())
)


async def renew_over(
    link: Link, *, key_ids: list[int], now: datetime
) -> dict[int, Principal | AuthFailure]:
    """``renew`` on a replica's own PostgreSQL connection (``gateway.db.link``): the same
    verdicts, read on the event loop in one round trip per chunk, with no session or thread."""
    verdicts: dict[int, Principal | AuthFailure] = {}
    for start in range(0, len(key_ids), RENEW_CHUNK):
        for row in await link.rows(_RENEW_BY_IDS, {"ids": key_ids[start : start + RENEW_CHUNK]}):
            verdicts[row.key_id] = _verdict(row, now)
    return verdicts


def _verdict(row: Any, now: datetime) -> Principal | AuthFailure:
    """A key whose secret matched (a ``_KEY_ROW``): its tenant, or why it is refused now."""
    if row.revoked_at is not None and row.revoked_at <= now:
        return AuthFailure.REVOKED
    if row.expires_at is not None and row.expires_at <= now:
        return AuthFailure.EXPIRED
    if TenantStatus(row.status) is not TenantStatus.ACTIVE:
        return AuthFailure.TENANT_DISABLED
    plan = TenantPlan(
        requests_per_minute=row.requests_per_minute,
        tokens_per_minute=row.tokens_per_minute,
        max_concurrency=row.max_concurrency,
        max_context_tokens=row.max_context_tokens,
    )
    return Principal(
        tenant_id=row.tenant_id,
        tenant_name=row.tenant_name,
        key_id=row.key_id,
        key_prefix=row.prefix,
        plan=plan,
        synthetic=row.synthetic,
        canary_sample_rate=row.canary_sample_rate,
        key_last_used_at=row.last_used_at,
        key_expires_at=row.expires_at,
    )


def prefixes_after(session: Session, *, after_id: int, limit: int) -> list[tuple[int, str]]:
    """(id, prefix) of the first ``limit`` keys stored after ``after_id`` (revoked ones too),
    oldest first: how a replica learns which prefixes exist
    (``gateway.services.auth_cache.KnownPrefixes``)."""
    query = select(ApiKey.id, ApiKey.prefix).where(ApiKey.id > after_id).order_by(ApiKey.id)
    return [(key_id, prefix) for key_id, prefix in session.execute(query.limit(limit))]


_KEYS = cast(Table, ApiKey.__table__)  # the table itself: Core's executemany, no ORM checks
_TOUCH = update(_KEYS).where(_KEYS.c.id == bindparam("key_id")).values(last_used_at=bindparam("at"))


def touch_keys(session: Session, *, last_used: dict[int, datetime]) -> None:
    """Record last use for many keys at once (batched off the request path): one statement
    executed for all of them (psycopg pipelines the executemany: one round trip, where a
    statement per key cost one each, ten per audit flush with ten tenants busy). A key deleted
    since it was used matches no row, which is no error."""
    if last_used:
        stamps = [{"key_id": key_id, "at": at} for key_id, at in last_used.items()]
        session.execute(_TOUCH, stamps)


_TOUCH_SQL = str(_TOUCH.compile(dialect=PGDialect_psycopg()))  # ``touch_keys`` without the ORM


async def touch_keys_on(
    conn: psycopg.AsyncConnection[Any], *, last_used: dict[int, datetime]
) -> None:
    """``touch_keys`` on a ``gateway.db.link.Link``'s connection (the audit writer's flush on
    PostgreSQL): the same statement, executed for every key in one pipelined executemany."""
    if last_used:
        stamps = [{"key_id": key_id, "at": at} for key_id, at in last_used.items()]
        async with conn.cursor() as cursor:
            await cursor.executemany(_TOUCH_SQL, stamps)
