"""What stands in front of every console route: the session, the CSRF checks, the headers.

- ``SignedInDep``: the request's session cookie names a live session (``gateway.console.sessions``).
  Nothing else signs a request in: no bearer token (not even the admin token), no query string.
  Without one, a page (GET) redirects to the sign-in form and anything else is a 401.
- ``ActionDep`` (every POST that changes something): signed in, sent by a page of the console
  itself -- the browser's ``Sec-Fetch-Site``/``Origin`` say same-origin when it sends them -- and
  carrying the session's CSRF token in the form. The cookie is ``SameSite=Strict`` as well, so a
  cross-site form post arrives without it; the checks here hold even for a browser that sends it.
  Like the admin API, an action empties this replica's key cache (a revocation applies at once).
- ``ConsoleRoute``: every console response gets the security headers (a strict CSP: no inline
  script or style, nothing from another origin), and errors become HTML pages, never tracebacks.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any
from urllib.parse import urlsplit

from fastapi import Depends, Request
from fastapi.routing import APIRoute
from starlette.responses import RedirectResponse, Response

from contracts.sql import DATABASE_ERRORS, is_outage, run_in_session, utcnow
from gateway.console import render
from gateway.console.forms import parse_form
from gateway.console.sessions import SignedIn, find_session
from gateway.deps import StateDep
from gateway.errors import GatewayError
from gateway.state import GatewayState

SESSION_COOKIE = "kvguard_console"
LOGIN_COOKIE = "kvguard_console_login"  # the sign-in form's own CSRF token (double submit)
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",  # "no-referrer" would make a form's Origin "null"
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}


class ConsoleRefusal(Exception):
    status = 403

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SignInFirst(ConsoleRefusal):
    status = 401


class NotFromConsole(ConsoleRefusal):
    status = 403


# -- the session -----------------------------------------------------------------------------------


async def signed_in(request: Request, state: StateDep) -> SignedIn:
    token = request.cookies.get(SESSION_COOKIE)
    if not token:
        raise SignInFirst("Sign in to the console first.")
    secret = state.settings.admin_secret()
    found = await run_in_session(
        state.sessions,
        lambda s: find_session(s, token=token, admin_secret=secret, now=utcnow()),
    )
    if found is None:
        raise SignInFirst("The console session has ended (expired or signed out): sign in again.")
    return found


SignedInDep = Annotated[SignedIn, Depends(signed_in)]


def same_origin(request: Request) -> bool:
    """False when the browser says the request comes from another site or origin."""
    site = request.headers.get("sec-fetch-site")
    if site is not None and site != "same-origin":
        return False
    origin = request.headers.get("origin")
    if origin is None:
        return True  # not a browser's cross-origin post (they send Origin on every POST)
    host = request.headers.get("host")
    return origin != "null" and host is not None and urlsplit(origin).netloc == host


@dataclass(frozen=True, slots=True)
class Action:
    """A checked console action: who (the session) and the posted fields."""

    signed: SignedIn
    form: dict[str, str]


async def checked_action(request: Request, state: StateDep, signed: SignedInDep) -> Action:
    if not same_origin(request):
        raise NotFromConsole("Refused: this form was not sent by a console page.")
    form = parse_form(await request.body(), request.headers.get("content-type"))
    if not hmac.compare_digest(form.get("csrf", "").encode(), signed.csrf.encode()):
        raise NotFromConsole("Refused: the form's CSRF token is missing or wrong; reload the page.")
    state.auth_cache.clear()  # as the admin API does on any change: revocations apply at once
    return Action(signed=signed, form=form)


ActionDep = Annotated[Action, Depends(checked_action)]


def set_cookie(
    response: Response,
    request: Request,
    state: GatewayState,
    *,
    name: str,
    value: str,
    max_age_s: int,
) -> None:
    secure = request.url.scheme == "https" or state.settings.console_cookie_secure
    response.set_cookie(
        name,
        value,
        max_age=max_age_s,
        path=render.ROOT,
        httponly=True,
        samesite="strict",
        secure=secure,
    )


# -- every response --------------------------------------------------------------------------------


def _back(request: Request) -> str:
    """Where an error page links back to: the tenant or section the request was about."""
    tenant = request.path_params.get("tenant_id")
    if tenant:
        return f"{render.ROOT}/tenants/{tenant}"
    section = request.url.path.removeprefix(render.ROOT).strip("/").split("/")[0]
    return f"{render.ROOT}/{section}" if section in ("tenants", "engines") else render.ROOT


def error_page(
    request: Request,
    status: int,
    message: str,
    headers: dict[str, str] | None = None,
    *,
    back: tuple[str, str] | None = None,
) -> Response:
    """A refusal or failure as a page: what happened, and a link onwards (default: back to the
    tenant or section the request was about)."""
    link, label = back or (_back(request), "Back")
    context = {"title": "Refused" if status < 500 else "Unavailable", "message": message}
    context |= {"back": link, "back_label": label}
    return render.page(request, "error.html", context, signed=None, status=status, headers=headers)


def refusal(request: Request, exc: ConsoleRefusal) -> Response:
    sign_in = f"{render.ROOT}/login"
    if isinstance(exc, SignInFirst):
        if request.method in ("GET", "HEAD"):
            return RedirectResponse(sign_in, status_code=303)
        return error_page(request, exc.status, exc.message, back=(sign_in, "Sign in"))
    return error_page(request, exc.status, exc.message)


Handler = Callable[[Request], Coroutine[Any, Any, Response]]


class ConsoleRoute(APIRoute):
    """A console route: refusals and errors as pages, the security headers on every answer."""

    def get_route_handler(self) -> Handler:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                response = await handler(request)
            except ConsoleRefusal as exc:
                response = refusal(request, exc)
            except GatewayError as exc:
                response = error_page(request, exc.status, exc.message, exc.headers)
            except DATABASE_ERRORS as exc:
                if not is_outage(exc):
                    raise
                message = "The gateway's database is unavailable; retry later."
                response = error_page(request, 503, message)
            response.headers.update(SECURITY_HEADERS)
            response.headers.setdefault("Cache-Control", "no-store")
            return response

        return guarded
