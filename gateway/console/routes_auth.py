"""Signing in and out of the console.

Sign-in: ``GET /console/login`` shows the form with a fresh one-time token, also set as a cookie
(a cross-site page can read neither, so it cannot sign a browser into *its* session) ->
``POST /console/login`` with the admin token: refused from another origin or without the matching
token; a wrong admin token is counted against the admin API's per-address throttle
(``gateway.deps.check_admin_login``) -> a new session (``gateway.console.sessions``) in the
``HttpOnly``, ``SameSite=Strict`` cookie, and a redirect to the console. The token never appears
in a URL: the form posts it in the body.

Sign-out: ``POST /console/logout`` (a checked action) deletes the session row and the cookie.
"""

from __future__ import annotations

import hmac
import secrets

from fastapi import APIRouter, Request
from starlette.responses import RedirectResponse, Response

from contracts.sql import run_in_session, utcnow
from gateway.console import render
from gateway.console.forms import parse_form
from gateway.console.guard import (
    LOGIN_COOKIE,
    SESSION_COOKIE,
    ActionDep,
    ConsoleRoute,
    NotFromConsole,
    same_origin,
    set_cookie,
)
from gateway.console.sessions import close_session, find_session, open_session
from gateway.deps import StateDep, check_admin_login
from gateway.errors import GatewayError
from gateway.state import GatewayState

router = APIRouter(prefix=render.ROOT, route_class=ConsoleRoute, include_in_schema=False)
LOGIN_FORM_S = 15 * 60  # how long a sign-in form stays usable


def _login_page(
    request: Request, state: GatewayState, *, status: int = 200, error: str | None = None
) -> Response:
    form_token = secrets.token_urlsafe(32)
    context = {"title": "Sign in", "form_token": form_token, "error": error}
    response = render.page(request, "login.html", context, signed=None, status=status)
    set_cookie(
        response, request, state, name=LOGIN_COOKIE, value=form_token, max_age_s=LOGIN_FORM_S
    )
    return response


@router.get("/login")
async def login_form(request: Request, state: StateDep) -> Response:
    token = request.cookies.get(SESSION_COOKIE)
    if token:
        secret = state.settings.admin_secret()
        live = await run_in_session(
            state.sessions,
            lambda s: find_session(s, token=token, admin_secret=secret, now=utcnow()),
        )
        if live is not None:
            return RedirectResponse(render.ROOT, status_code=303)
    return _login_page(request, state)


@router.post("/login")
async def login(request: Request, state: StateDep) -> Response:
    if not same_origin(request):
        raise NotFromConsole("Refused: this sign-in was not sent by the console's own form.")
    form = parse_form(await request.body(), request.headers.get("content-type"))
    expected = request.cookies.get(LOGIN_COOKIE, "")
    presented = form.get("form_token", "")
    if not expected or not hmac.compare_digest(presented.encode(), expected.encode()):
        error = "The sign-in form expired or was not this browser's: please sign in again."
        return _login_page(request, state, status=403, error=error)
    try:
        check_admin_login(request, state, form.get("token", ""))
    except GatewayError as exc:
        response = _login_page(request, state, status=exc.status, error=exc.message)
        response.headers.update(exc.headers)
        return response
    ttl_s = state.settings.console_session_ttl_s
    secret = state.settings.admin_secret()
    signed = await run_in_session(
        state.sessions,
        lambda s: open_session(s, admin_secret=secret, ttl_s=ttl_s, now=utcnow()),
    )
    response = RedirectResponse(render.ROOT, status_code=303)
    set_cookie(
        response, request, state, name=SESSION_COOKIE, value=signed.token, max_age_s=int(ttl_s)
    )
    response.delete_cookie(LOGIN_COOKIE, path=render.ROOT, httponly=True, samesite="strict")
    return response


@router.post("/logout")
async def logout(action: ActionDep, state: StateDep) -> Response:
    token = action.signed.token
    await run_in_session(state.sessions, lambda s: close_session(s, token=token))
    response = RedirectResponse(f"{render.ROOT}/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path=render.ROOT, httponly=True, samesite="strict")
    return response
