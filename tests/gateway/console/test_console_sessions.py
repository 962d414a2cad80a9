"""Console sign-in and sessions, on real gateway apps sharing one SQLite database.

Proves: the sign-in form posts the admin token in its body and answers with a session cookie of
its own (``HttpOnly``, ``SameSite=Strict``, path ``/console``, ``Secure`` over HTTPS or when told);
a wrong admin token or a tenant key is refused and counted against the admin API's per-address
throttle (the same bucket: the admin API refuses that address too); a sign-in post without the
form's own token, or from another origin, opens nothing; a session opened on one replica works on
another (the state is in the database, not a process), and signing out on one ends it on both; an
expired session and every session opened under a previous admin token are refused.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import AsyncIterator, Callable
from datetime import timedelta

import httpx
import pytest
from console_harness import async_sign_in
from gateway_harness import Gateway, running_gateway
from sqlalchemy import update

from contracts.sql import session_scope, utcnow
from gateway.config import GatewaySettings
from gateway.console.guard import LOGIN_COOKIE, SESSION_COOKIE
from gateway.db.models import ConsoleSession

ADMIN = "console-admin-token-" + "a" * 32


@pytest.fixture
def settings(make_settings: Callable[..., GatewaySettings]) -> Callable[..., GatewaySettings]:
    def make(**overrides: object) -> GatewaySettings:
        return make_settings(**{"admin_token": ADMIN, **overrides})

    return make


@contextlib.asynccontextmanager
async def browser_like(
    gw: Gateway, base_url: str = "http://gateway"
) -> AsyncIterator[httpx.AsyncClient]:
    """A client with a cookie jar of its own on ``gw`` (as one browser would be)."""
    transport = httpx.ASGITransport(app=gw.app)
    async with httpx.AsyncClient(transport=transport, base_url=base_url) as client:
        yield client


def _set_cookies(response: httpx.Response) -> dict[str, str]:
    found = {}
    for header in response.headers.get_list("set-cookie"):
        name = header.split("=", 1)[0]
        found[name] = header
    return found


async def _form_token(client: httpx.AsyncClient) -> str:
    page = await client.get("/console/login")
    match = re.search(r'name="form_token" value="([^"]+)"', page.text)
    assert match is not None
    return match.group(1)


async def test_sign_in_answers_with_a_session_cookie_of_its_own(settings) -> None:
    async with running_gateway(settings()) as gw, browser_like(gw) as client:
        assert (await client.get("/console")).headers["location"] == "/console/login"
        page = await client.get("/console/login")
        assert '<form method="post" action="/console/login"' in page.text
        r = await client.post(
            "/console/login", data={"form_token": await _form_token(client), "token": ADMIN}
        )
        assert r.status_code == 303 and r.headers["location"] == "/console"
        cookie = _set_cookies(r)[SESSION_COOKIE]
        assert ADMIN not in cookie and ADMIN not in r.headers["location"]
        attributes = {part.strip().lower() for part in cookie.split(";")[1:]}
        assert {"httponly", "samesite=strict", "path=/console", "max-age=28800"} <= attributes
        assert "secure" not in attributes  # plain HTTP here: see the next test
        for path in ("/console", "/console/tenants", "/console/engines"):
            assert (await client.get(path)).status_code == 200, path


@pytest.mark.parametrize(
    ("base_url", "forced"),
    [("https://gateway", False), ("http://gateway", True)],
    ids=["over HTTPS", "told (TLS ends at a proxy)"],
)
async def test_the_cookies_are_secure_over_https_or_when_told(
    settings, base_url: str, forced: bool
) -> None:
    async with (
        running_gateway(settings(console_cookie_secure=forced)) as gw,
        browser_like(gw, base_url) as client,
    ):
        form = await client.get("/console/login")
        login_cookie = _set_cookies(form)[LOGIN_COOKIE]
        assert "; secure" in login_cookie.lower()
        token = re.search(r'name="form_token" value="([^"]+)"', form.text)
        assert token is not None
        # sent by hand: a Secure cookie does not travel back over plain HTTP (the point of it)
        value = login_cookie.split(";")[0]
        r = await client.post(
            "/console/login",
            data={"form_token": token.group(1), "token": ADMIN},
            headers={"Cookie": value},
        )
        assert r.status_code == 303
        assert "; secure" in _set_cookies(r)[SESSION_COOKIE].lower()


async def test_wrong_tokens_are_refused_and_throttled_with_the_admin_api(settings) -> None:
    async with running_gateway(settings(operator_failures_per_minute=3)) as gw:
        _, tenant_key = await gw.create_tenant("acme")
        async with browser_like(gw) as client:
            r = await client.post(
                "/console/login",
                data={"form_token": await _form_token(client), "token": tenant_key},
            )
            assert r.status_code == 401 and "Tenant API keys cannot sign in" in r.text
            for _ in range(3):
                r = await client.post(
                    "/console/login",
                    data={"form_token": await _form_token(client), "token": "x" * 40},
                )
                assert r.status_code == 401 and "Incorrect admin token" in r.text
                assert SESSION_COOKIE not in _set_cookies(r)
            r = await client.post(
                "/console/login", data={"form_token": await _form_token(client), "token": ADMIN}
            )
            assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
            assert SESSION_COOKIE not in _set_cookies(r)
        # the same bucket as the admin API's: the right bearer token waits as well
        admin = await gw.client.get("/admin/tenants", headers=gw.admin)
        assert admin.status_code == 429


async def test_a_sign_in_post_needs_the_forms_own_token_and_origin(settings) -> None:
    async with running_gateway(settings()) as gw, browser_like(gw) as client:
        r = await client.post("/console/login", data={"form_token": "forged", "token": ADMIN})
        assert r.status_code == 403 and SESSION_COOKIE not in _set_cookies(r)
        token = await _form_token(client)
        r = await client.post(
            "/console/login",
            data={"form_token": token, "token": ADMIN},
            headers={"Origin": "http://evil.example"},
        )
        assert r.status_code == 403 and SESSION_COOKIE not in _set_cookies(r)
        r = await client.post("/console/login", data={"form_token": token, "token": ADMIN})
        assert r.status_code == 303  # the same form, from its own origin


async def test_a_session_works_on_every_replica_and_sign_out_ends_it_everywhere(
    settings,
) -> None:
    shared = settings()
    async with (
        running_gateway(shared) as one,
        running_gateway(shared) as two,
        browser_like(one) as first,
        browser_like(two) as second,
    ):
        csrf = await async_sign_in(first, ADMIN)
        second.cookies.set(SESSION_COOKIE, first.cookies[SESSION_COOKIE], path="/console")
        assert (await second.get("/console/tenants")).status_code == 200  # the other replica
        r = await second.post("/console/logout", data={"csrf": csrf})
        assert r.status_code == 303 and r.headers["location"] == "/console/login"
        r = await first.get("/console")
        assert (r.status_code, r.headers["location"]) == (303, "/console/login")


async def test_an_expired_session_is_refused(settings) -> None:
    async with running_gateway(settings()) as gw, browser_like(gw) as client:
        await async_sign_in(client, ADMIN)
        assert (await client.get("/console")).status_code == 200
        with session_scope(gw.state.sessions) as session:
            session.execute(
                update(ConsoleSession).values(expires_at=utcnow() - timedelta(seconds=1))
            )
        r = await client.get("/console")
        assert (r.status_code, r.headers["location"]) == (303, "/console/login")
        r = await client.post("/console/logout", data={"csrf": "x"})
        assert r.status_code == 401 and 'href="/console/login">Sign in<' in r.text


async def test_a_new_admin_token_ends_every_session(settings) -> None:
    async with running_gateway(settings()) as old, browser_like(old) as client:
        await async_sign_in(client, ADMIN)
        cookie = client.cookies[SESSION_COOKIE]
    rotated = settings(admin_token="rotated-admin-token-" + "b" * 32)
    async with running_gateway(rotated) as new, browser_like(new) as client:
        client.cookies.set(SESSION_COOKIE, cookie, path="/console")
        r = await client.get("/console")
        assert (r.status_code, r.headers["location"]) == (303, "/console/login")
