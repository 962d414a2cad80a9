"""FastAPI dependencies as ``Annotated`` aliases: state, DB session, the tenant, the admin.

Credentials: tenants send ``Authorization: Bearer kvg_<prefix>_<secret>``; the admin API takes
only the separate admin token (a tenant key there is refused, whatever tenant it belongs to);
``/metrics`` (every tenant's series) takes the metrics token or the admin token, never a tenant key.
Wrong credentials -- operator tokens and tenant keys, in separate budgets -- are throttled per
client address (``gateway.limits.auth_throttle``), the address ``client_address`` derives: the
real peer, or what a proxy the operator lists (``KVGUARD_TRUSTED_PROXIES``) forwarded. A tenant
key is looked up in the database at most once per flight and lane (``gateway.services.auth_cache``),
and the keys in use are verified again in the background (``renew_verified_keys``).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from functools import partial
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session
from starlette.datastructures import Headers

from contracts import grid
from contracts.sql import run_in_session, session_scope
from gateway.config import GatewaySettings, IPNetwork
from gateway.db.link import Link
from gateway.domain import Principal
from gateway.errors import AuthenticationFailed, PermissionDenied, RateLimited
from gateway.limits.auth_throttle import Bucket
from gateway.services.auth_cache import Verdict
from gateway.services.keys import (
    AuthFailure,
    authenticate,
    looks_like_tenant_key,
    parse_key,
    prefixes_after,
    renew,
    renew_over,
)
from gateway.state import GatewayState

log = logging.getLogger("kvguard.gateway.auth")

_AUTH_MESSAGES = {
    AuthFailure.MALFORMED: "Invalid API key format: expected kvg_<prefix>_<secret>.",
    AuthFailure.UNKNOWN: "Incorrect API key provided.",
    AuthFailure.REVOKED: "This API key has been revoked.",
    AuthFailure.EXPIRED: "This API key has expired.",
}


async def get_state(request: Request) -> GatewayState:
    # async on purpose: FastAPI runs a sync dependency in its threadpool (a hop per request)
    state: GatewayState = request.app.state.gateway
    return state


StateDep = Annotated[GatewayState, Depends(get_state)]


def get_session(state: StateDep) -> Iterator[Session]:
    with session_scope(state.sessions) as session:
        yield session


# scope="function": commit before the response is sent, so a client never reads stale state.
SessionDep = Annotated[Session, Depends(get_session, scope="function")]


def bearer_token(request: Request) -> str:
    return bearer_of(request.headers.get("authorization"))


def bearer_of(header: str | None) -> str:
    """The token of an ``Authorization: Bearer <token>`` header (401 when there is none)."""
    if not header:
        raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed("Malformed Authorization header: expected 'Bearer <key>'.")
    return token.strip()


async def current_principal(request: Request, state: StateDep) -> Principal:
    return await principal_of(
        state, bearer_token(request), address=lambda: client_address(request, state.settings)
    )


async def principal_of(state: GatewayState, token: str, *, address: Callable[[], str]) -> Principal:
    """The tenant behind ``token``: from this replica's cache, or from one database lookup shared
    by every request in flight with the same key. An address (``address()``, asked only when the
    cache does not know the key) whose unverified keys failed too often gets 429 before any
    lookup (a key this replica verified still works). Shared by FastAPI's routes and the data
    plane's door."""
    now = state.clock()
    verdict = state.auth_cache.get(token, now=now)
    if isinstance(verdict, Principal):
        return verdict
    settings = state.settings
    client = address()
    budget = settings.auth_failures_per_minute
    retry = state.credential_throttle.retry_after_s(client, bucket=Bucket.TENANT, capacity=budget)
    if retry is not None:
        raise RateLimited(
            "Too many failed API keys from this address; retry later.",
            retry_after_s=retry,
            code="too_many_failed_credentials",
        )
    if verdict is None:
        verdict = await _verify(state, token, now)
    if isinstance(verdict, AuthFailure):
        state.credential_throttle.failed(client, bucket=Bucket.TENANT, capacity=budget)
        if verdict is AuthFailure.TENANT_DISABLED:
            raise PermissionDenied("This tenant is disabled.", code="tenant_disabled")
        raise AuthenticationFailed(_AUTH_MESSAGES[verdict])
    return verdict


async def _verify(state: GatewayState, token: str, now: datetime) -> Principal | AuthFailure:
    """What the database says about a token this replica knows nothing of: malformed and
    unknown-prefix tokens without a lookup of their own (``KnownPrefixes``), the rest by one."""
    parsed = parse_key(token)
    if parsed is None:
        return AuthFailure.MALFORMED
    cache, timeout_s = state.auth_cache, state.settings.database_timeout_s
    fetch = partial(_prefixes_after, state)
    if not await cache.prefixes.holds(parsed.prefix, fetch=fetch, timeout_s=timeout_s):
        cache.put(token, AuthFailure.UNKNOWN, now=now)
        return AuthFailure.UNKNOWN
    lookup = partial(_lookup, state, token, now)
    return await cache.verify(token, now=now, lookup=lookup, timeout_s=timeout_s)


async def _prefixes_after(state: GatewayState, after_id: int, limit: int) -> list[tuple[int, str]]:
    return await run_in_session(
        state.sessions, lambda session: prefixes_after(session, after_id=after_id, limit=limit)
    )


async def _lookup(state: GatewayState, token: str, now: datetime) -> Principal | AuthFailure:
    """One database verification of ``token`` (the key's last use is recorded, batched)."""
    links = state.lookup_links
    if links is None:
        result = await run_in_session(
            state.sessions, lambda session: authenticate(session, token=token, now=now)
        )
    else:  # PostgreSQL: a connection of the lane's own, on the event loop (no session or thread)
        verified_before = state.auth_cache.verified_before(token)
        result = await links.authenticate(token, now=now, verified_before=verified_before)
    if isinstance(result, Principal):
        _stamp_use(state, result, now)
    return result


def _stamp_use(state: GatewayState, principal: Principal, now: datetime) -> None:
    """Record the key's last use (batched), at most once per ``key_last_used_interval_s``."""
    interval = timedelta(seconds=state.settings.key_last_used_interval_s)
    if principal.key_last_used_at is None or now - principal.key_last_used_at >= interval:
        state.audit.touch_key(principal.key_id, now)


async def renew_verified_keys(state: GatewayState) -> None:
    """The replica's renewal loop (``AuthCache.renew``): every half ``auth_cache_ttl_s``, the keys
    used in the last two rounds (served from the cache or looked up) are verified again in one
    read, and their last use stamped as ``_lookup`` does. A round that fails is logged; its keys
    expire and the request path verifies them. Nothing to do when the ttl is 0 (nothing is
    cached)."""
    cache = state.auth_cache
    interval = cache.renewal_interval_s
    if interval is None:
        return
    # PostgreSQL: the loop's own connection on the event loop (``gateway.db.link``: no worker
    # thread, no pooled session); another database: a session like any other read
    link = Link.of(state.db, timeout_s=state.settings.database_timeout_s)
    try:
        while True:
            await grid.sleep(interval)
            now = state.clock()
            fetch = partial(_renew, state, now) if link is None else partial(_renew_on, link, now)
            try:
                renewed = await cache.renew(fetch, now=now)
            except Exception:
                log.warning("renewing verified keys failed; they are verified on their next use")
                continue
            for principal in renewed:
                _stamp_use(state, principal, now)
    finally:
        if link is not None:
            await link.close()


async def _renew(state: GatewayState, now: datetime, key_ids: list[int]) -> dict[int, Verdict]:
    return await run_in_session(
        state.sessions, lambda session: renew(session, key_ids=key_ids, now=now)
    )


async def _renew_on(link: Link, now: datetime, key_ids: list[int]) -> dict[int, Verdict]:
    return await renew_over(link, key_ids=key_ids, now=now)


CurrentTenant = Annotated[Principal, Depends(current_principal)]


def client_address(request: Request, settings: GatewaySettings) -> str:
    """Who sent the request, for every per-address decision: the TCP peer, unless the peer is a
    proxy the operator lists (``KVGUARD_TRUSTED_PROXIES``) -- then the nearest address the
    proxies forwarded (``X-Forwarded-For``, else ``Forwarded``, else ``X-Real-IP``) that is not
    itself a listed proxy. A client's own forwarded headers are never believed: no one can pick
    the address its failures are counted against, or escape its own."""
    peer = request.client.host if request.client is not None else None
    return address_of(peer, request.headers, settings)


def address_of(peer: str | None, headers: Headers, settings: GatewaySettings) -> str:
    """``client_address`` from the TCP peer and the request's headers (the data plane's door has
    an ASGI scope, not a Request)."""
    peer = peer or "unknown"
    trusted = settings.trusted_proxy_networks()
    if not trusted or not _listed(peer, trusted):
        return peer
    for address in reversed(forwarded_chain(headers)):
        if not _listed(address, trusted):
            return address
    return peer


def forwarded_chain(headers: Headers) -> list[str]:
    """The client addresses forwarding proxies recorded, nearest last (unparsable ones dropped)."""
    if "x-forwarded-for" in headers:
        hops = [hop for value in headers.getlist("x-forwarded-for") for hop in value.split(",")]
    elif "forwarded" in headers:
        hops = [
            part.split("=", 1)[1]
            for value in headers.getlist("forwarded")
            for element in value.split(",")
            for part in element.split(";")
            if part.strip().lower().startswith("for=")
        ]
    else:
        hops = headers.getlist("x-real-ip")
    return [address for hop in hops if (address := _address(hop)) is not None]


def _address(hop: str) -> str | None:
    """``hop`` as a plain IP address: quotes, an IPv6 bracket and a port removed; else None."""
    text = hop.strip().strip('"')
    if text.startswith("["):
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:
        text = text.partition(":")[0]
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return None


def _listed(address: str, networks: tuple[IPNetwork, ...]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in network for network in networks)


def _check_operator_token(
    request: Request,
    state: GatewayState,
    accepted: tuple[str, ...],
    *,
    what: str,
    presented: str | None = None,
) -> None:
    """Compare an operator credential (the bearer token, or ``presented``) with every accepted
    one (no shortcut), throttling an address after repeated failures
    (``FailedCredentialThrottle``)."""
    address = client_address(request, state.settings)
    retry = state.credential_throttle.retry_after_s(address)
    if retry is not None:
        raise RateLimited(
            "Too many failed credentials from this address; retry later.",
            retry_after_s=retry,
            code="too_many_failed_credentials",
        )
    token = (bearer_token(request) if presented is None else presented).encode()
    matches = [hmac.compare_digest(token, secret.encode()) for secret in accepted]
    if not any(matches):
        state.credential_throttle.failed(address)
        raise AuthenticationFailed(f"Incorrect {what} token.")


def require_admin(request: Request, state: StateDep) -> None:
    token = bearer_token(request)
    if looks_like_tenant_key(token):
        raise AuthenticationFailed("Tenant API keys cannot use the admin API.")
    _check_operator_token(request, state, (state.settings.admin_secret(),), what="admin")
    if request.method != "GET":
        state.auth_cache.clear()  # any admin change (revoke, disable, limits) applies at once


AdminDep = Annotated[None, Depends(require_admin)]


def check_admin_login(request: Request, state: GatewayState, token: str) -> None:
    """The admin token typed into the console's sign-in form: refused like a wrong bearer token on
    the admin API, and counted against the same per-address throttle."""
    if looks_like_tenant_key(token):
        raise AuthenticationFailed("Tenant API keys cannot sign in to the console.")
    secret = state.settings.admin_secret()
    _check_operator_token(request, state, (secret,), what="admin", presented=token)


def require_scraper(request: Request, state: StateDep) -> None:
    """``/metrics``: the metrics token or the admin token (open only in development when unset)."""
    expected = state.settings.metrics_secret()
    if expected is None:
        return
    token = bearer_token(request)
    if looks_like_tenant_key(token):
        raise AuthenticationFailed("Tenant API keys cannot read /metrics.")
    accepted = (expected, state.settings.admin_secret())
    _check_operator_token(request, state, accepted, what="metrics")


ScraperDep = Annotated[None, Depends(require_scraper)]
