"""What guards every console route: CSRF, the security headers, pages without inline code, errors
as pages, and assets that ship in the package. On a real gateway app with SQLite.

Attacker: a page on another origin that makes the operator's browser post a console form (with or
without the session cookie: SameSite keeps it from another site, not from another port of the
same host), a form with the CSRF token missing or guessed, and odd bodies. Every refusal must
change nothing (the same form with the right token then works, so the check is what refused).
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from console_harness import async_sign_in, console_routes
from gateway_harness import Gateway

from gateway.console.guard import CSP
from gateway.console.render import STATIC, TEMPLATES

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
async def signed(gateway: Gateway) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    """A client signed in to the console (its own cookie jar) and the session's CSRF token."""
    transport = httpx.ASGITransport(app=gateway.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        csrf = await async_sign_in(client, gateway.state.settings.admin_secret())
        yield client, csrf


async def _tenant_names(gateway: Gateway) -> list[str]:
    r = await gateway.client.get("/admin/tenants", headers=gateway.admin)
    return [t["name"] for t in r.json()]


@pytest.mark.parametrize(
    ("form", "headers"),
    [
        ({"name": "forged"}, {}),
        ({"name": "forged", "csrf": "0" * 64}, {}),
        ({"name": "forged", "csrf": "{csrf}"}, {"Origin": "http://evil.example"}),
        ({"name": "forged", "csrf": "{csrf}"}, {"Origin": "null"}),
        ({"name": "forged", "csrf": "{csrf}"}, {"Sec-Fetch-Site": "cross-site"}),
        ({"name": "forged", "csrf": "{csrf}"}, {"Sec-Fetch-Site": "same-site"}),
    ],
    ids=["no token", "guessed token", "foreign origin", "opaque origin", "cross-site", "same-site"],
)
async def test_an_action_needs_the_sessions_token_and_its_own_origin(
    gateway: Gateway, signed, form: dict[str, str], headers: dict[str, str]
) -> None:
    client, csrf = signed
    filled = {name: value.format(csrf=csrf) for name, value in form.items()}
    r = await client.post("/console/tenants", data=filled, headers=headers)
    assert r.status_code == 403, r.text
    assert "Refused" in r.text
    assert "forged" not in await _tenant_names(gateway)
    r = await client.post("/console/tenants", data={"name": "forged", "csrf": csrf})
    assert r.status_code == 200 and "forged" in await _tenant_names(gateway)


async def test_every_console_answer_carries_the_security_headers(gateway: Gateway, signed) -> None:
    client, csrf = signed
    tenant_id, _ = await gateway.create_tenant("acme")
    paths = ["/console", "/console/tenants", f"/console/tenants/{tenant_id}", "/console/engines"]
    paths += ["/console/tenants/tn_missing", "/console/static/console.css"]
    paths += ["/console/static/console.js", "/console/static/favicon.svg"]
    answers = [await client.get(path) for path in paths]
    answers.append(await client.post("/console/tenants", data={"name": "x"}))  # refused: 403
    transport = httpx.ASGITransport(app=gateway.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as stranger:
        answers += [await stranger.get("/console/login"), await stranger.get("/console")]
    for r in answers:
        where = f"{r.request.method} {r.url.path} -> {r.status_code}"
        assert r.headers["content-security-policy"] == CSP, where
        assert r.headers["x-content-type-options"] == "nosniff", where
        assert r.headers["x-frame-options"] == "DENY", where
    assert "default-src 'self'" in CSP and "unsafe-inline" not in CSP and "http" not in CSP
    assert [r.status_code for r in answers[-5:]] == [200, 200, 403, 200, 303]


INLINE = {
    "an inline script": re.compile(r"<script(?![^>]*\bsrc=)", re.I),
    "a style element": re.compile(r"<style", re.I),
    "a style attribute": re.compile(r"\sstyle\s*=", re.I),
    "an event handler attribute": re.compile(r"\son[a-z]+\s*=", re.I),
    "a javascript: URL": re.compile(r"javascript:", re.I),
    "an asset from elsewhere": re.compile(r"\s(?:src|href)\s*=\s*\"(?!/console[/\"?#]|#|\?)", re.I),
}


async def test_pages_carry_no_inline_code_and_no_asset_from_elsewhere(
    gateway: Gateway, signed
) -> None:
    client, csrf = signed
    tenant_id, key = await gateway.create_tenant("acme")
    prefix = key.split("_")[1]
    await client.post("/console/tenants", data={"name": "second", "csrf": csrf})
    pages = {
        path: (await client.get(path)).text
        for path in (
            "/console",
            "/console/tenants",
            f"/console/tenants/{tenant_id}",
            "/console/engines",
        )
    }
    pages["key shown once"] = (
        await client.post(f"/console/tenants/{tenant_id}/keys", data={"csrf": csrf})
    ).text
    pages["after revoke"] = (
        await client.post(
            f"/console/keys/{prefix}/revoke", data={"csrf": csrf}, follow_redirects=True
        )
    ).text
    assert "revoked" in pages["after revoke"] and "kvg_" in pages["key shown once"]
    for where, html in pages.items():
        for what, pattern in INLINE.items():
            assert pattern.search(html) is None, f"{where} holds {what}"


@pytest.mark.parametrize(
    ("content_type", "body", "status", "says"),
    [
        ("application/json", b'{"name": "x"}', 400, "is sent as application/x-www-form-urlencoded"),
        ("application/x-www-form-urlencoded", b"name=a&name=b&csrf={csrf}", 400, "sent twice"),
        ("application/x-www-form-urlencoded", b"name=bad%20name&csrf={csrf}", 400, "name"),
        (
            "application/x-www-form-urlencoded",
            b"name=n&requests_per_minute=lots&csrf={csrf}",
            400,
            "requests_per_minute must be a whole number",
        ),
        ("application/x-www-form-urlencoded", b"name=%ff%fe&csrf={csrf}", 400, "could not be read"),
    ],
    ids=["json", "duplicate field", "invalid name", "not a number", "not utf-8"],
)
async def test_a_bad_form_is_a_clear_refusal_page(
    gateway: Gateway, signed, content_type: str, body: bytes, status: int, says: str
) -> None:
    client, csrf = signed
    r = await client.post(
        "/console/tenants",
        content=body.replace(b"{csrf}", csrf.encode()),
        headers={"Content-Type": content_type},
    )
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("text/html")
    assert says in r.text and "Traceback" not in r.text
    assert await _tenant_names(gateway) == []


async def test_an_unknown_tenant_or_engine_is_a_404_page(gateway: Gateway, signed) -> None:
    client, csrf = signed
    r = await client.get("/console/tenants/tn_0000")
    assert r.status_code == 404 and "no tenant" in r.text
    r = await client.post("/console/engines/nope/clear", data={"csrf": csrf, "reason": "why"})
    assert r.status_code == 404 and "no engine" in r.text


def test_every_template_and_asset_ships_in_the_package() -> None:
    """pyproject's package-data names every file the console serves (nothing from a CDN)."""
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["gateway.console"]
    package = TEMPLATES.parent
    files = [p for p in [*TEMPLATES.iterdir(), *STATIC.iterdir()] if p.is_file()]
    assert len(files) >= 8
    for path in files:
        relative = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(relative, pattern) for pattern in patterns), relative


def test_console_routes_stay_out_of_the_api_schema(gateway: Gateway) -> None:
    routes = console_routes(gateway.app)
    assert len(routes) >= 10
    assert not [path for path in gateway.app.openapi()["paths"] if path.startswith("/console")]
