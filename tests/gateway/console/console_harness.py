"""Helpers of the console tests: signing in over HTTP, the console's routes, the browser.

``sign_in`` drives the sign-in form as a browser does (GET the form and its one-time cookie, POST
the token in the body). ``console_routes`` lists every console route of an app from its own
routing table, so a route added later is covered by the hostile checks without a list to update.
``launch_chromium`` starts Debian's ``chromium`` (scripts/bootstrap.sh installs it) through
Playwright -- never Playwright's own browser download, which cannot reach the internet here.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
from fastapi.routing import APIRoute

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PUBLIC = {("GET", "/console/login"), ("POST", "/console/login")}  # how one signs in at all
_FORM_TOKEN = re.compile(r'name="form_token" value="([^"]+)"')
_CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def sign_in(client: httpx.Client, admin_token: str) -> str:
    """Sign ``client`` in (its cookie jar holds the session); the session's CSRF token."""
    form = client.get("/console/login")
    assert form.status_code == 200, form.text
    token = _FORM_TOKEN.search(form.text)
    assert token is not None
    r = client.post(
        "/console/login",
        data={"form_token": token.group(1), "token": admin_token},
        follow_redirects=False,
    )
    assert r.status_code == 303 and r.headers["location"] == "/console", r.text
    return csrf_of(client.get("/console").text)


async def async_sign_in(client: httpx.AsyncClient, admin_token: str) -> str:
    form = await client.get("/console/login")
    token = _FORM_TOKEN.search(form.text)
    assert token is not None
    r = await client.post(
        "/console/login", data={"form_token": token.group(1), "token": admin_token}
    )
    assert r.status_code == 303 and r.headers["location"] == "/console", r.text
    return csrf_of((await client.get("/console")).text)


def csrf_of(html: str) -> str:
    found = _CSRF.search(html)
    assert found is not None, "no CSRF token on the page"
    return found.group(1)


def _routes(routes: list[Any], prefix: str = "") -> list[tuple[str, str]]:
    """(method, path) of every route, walking included routers (FastAPI keeps them nested)."""
    found: list[tuple[str, str]] = []
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            found += _routes(included.routes, prefix + route.include_context.prefix)
        elif isinstance(route, APIRoute):
            found += [(m, prefix + route.path) for m in sorted(route.methods) if m != "HEAD"]
    return found


def console_routes(app: Any) -> list[tuple[str, str]]:
    """(method, path template) of every console route of ``app`` but the sign-in form's."""
    found = [(m, path) for m, path in _routes(app.routes) if path.startswith("/console")]
    return [call for call in found if call not in PUBLIC]


def launch_chromium(playwright: Any) -> Any:
    """Debian's chromium, headless, with a fresh profile (Playwright gives each launch a
    temporary user-data dir of its own)."""
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
