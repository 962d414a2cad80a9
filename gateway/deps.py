"""FastAPI dependencies as ``Annotated`` aliases: state, DB session, the tenant, the admin.

Credentials: tenants send ``Authorization: Bearer kvg_<prefix>_<secret>``; the admin API takes
only the separate admin token (a tenant key there is refused, whatever tenant it belongs to);
``/metrics`` (every tenant's series) takes the metrics token or the admin token, never a tenant key.
Wrong operator tokens are throttled per client address (``gateway.limits.auth_throttle``).
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from datetime import timedelta
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from contracts.sql import run_in_session, session_scope
from gateway.domain import Principal
from gateway.errors import AuthenticationFailed, PermissionDenied, RateLimited
from gateway.services.keys import AuthFailure, authenticate, looks_like_tenant_key
from gateway.state import GatewayState

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
    header = request.headers.get("authorization")
    if not header:
        raise AuthenticationFailed("Missing API key: send 'Authorization: Bearer <key>'.")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed("Malformed Authorization header: expected 'Bearer <key>'.")
    return token.strip()


async def current_principal(request: Request, state: StateDep) -> Principal:
    token = bearer_token(request)
    now = state.clock()
    cached = state.auth_cache.get(token, now=now)
    if cached is not None:
        return cached

    def lookup(session: Session) -> Principal | AuthFailure:
        return authenticate(session, token=token, now=now)

    result = await run_in_session(state.sessions, lookup)
    if isinstance(result, AuthFailure):
        if result is AuthFailure.TENANT_DISABLED:
            raise PermissionDenied("This tenant is disabled.", code="tenant_disabled")
        raise AuthenticationFailed(_AUTH_MESSAGES[result])
    interval = timedelta(seconds=state.settings.key_last_used_interval_s)
    if result.key_last_used_at is None or now - result.key_last_used_at >= interval:
        state.audit.touch_key(result.key_id, now)
    state.auth_cache.put(token, result, now=now)
    return result


CurrentTenant = Annotated[Principal, Depends(current_principal)]


def _client_address(request: Request) -> str:
    return request.client.host if request.client is not None else "unknown"


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
    address = _client_address(request)
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
