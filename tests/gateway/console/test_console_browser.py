"""The operator console in a real headless Chromium, against the drill stack after a leak drill.

The stack is ``kvguard demo``'s (``kvguard.drillstack``, the bundled model): the incident's
``drill`` engine, a ``guarded`` one, and the gateway with the canary firewall, as local processes
on 127.0.0.1 with SQLite. Before any test, tenant A's marked chat and tenant B's over-long one
replay the leak on ``drill``: the firewall cuts B's stream, stores a cross-tenant finding naming
A's request and quarantines the engine; an echo probe on ``guarded`` is reported like
``kvguard canary probe`` does; tenant A also chats on ``guarded`` with a sentence of its own, so its
prompt and answer text exist to look for.

Then an operator, in Chromium (Debian's ``chromium`` driven by Playwright; one browser and one
stack for the module): signs in, sees ``drill`` quarantined since when and by which finding, and
the finding's kind, evidence, tenants and request ids; clears the quarantine with a reason and sees
the action recorded; creates a tenant, reads its key once, uses it through the API, revokes it in
the console and sees the API refuse it. Hostile: every console route refuses without a session
(none, a tenant key, the admin token as a bearer header, a forged cookie); a form posted from
another site (cookie withheld: SameSite) and from another origin of the same site (cookie sent:
refused by the origin check) changes nothing; no served page or asset holds a marker, A's prompt or
A's answer. The browser reports no CSP violation on any page.

Screenshots of every page are written under the module's temp dir (printed); with
``KVGUARD_CONSOLE_SHOT=<path>.png`` the Isolation page's is also written there (how
``docs/console-isolation.png`` is made).
"""

from __future__ import annotations

import os
import secrets
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from console_harness import console_routes, launch_chromium, sign_in
from playwright.sync_api import Browser, Page, expect, sync_playwright

from gateway.app import create_app
from gateway.config import GatewaySettings
from kvguard import drillstack
from kvguard.demo import echo_probe
from kvguard.load.content import MARKER_PIECE_RE

pytestmark = pytest.mark.slow
BUNDLED_MODEL = (
    Path(drillstack.__file__).resolve().parents[1] / "backend" / "bundled" / "kvguard-tiny"
)
SHOT_ENV = "KVGUARD_CONSOLE_SHOT"
DEADLINE_S = 30.0


@dataclass(frozen=True)
class Drilled:
    stack: drillstack.DrillStack
    act: drillstack.Act
    finding: dict[str, Any]
    tenant_a: str
    tenant_b: str
    key_a: str
    texts: tuple[str, ...]  # A's own prompt sentence and answer: text no console page may hold
    shots: Path

    @property
    def url(self) -> str:
        return self.stack.gateway


def _until(check: Any, what: str) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while not (value := check()):
        assert time.monotonic() < deadline, f"{what}: not within {DEADLINE_S} s"
        time.sleep(0.1)
    return value


def _own_chat(client: httpx.Client, key: str) -> tuple[str, str]:
    """Tenant A chats on ``guarded`` with a sentence of its own: (the sentence, the answer)."""
    sentence = f"console check sentence {secrets.token_hex(8)}"
    body = {
        "model": drillstack.GUARDED_MODEL,
        "messages": [{"role": "user", "content": sentence}],
        "max_tokens": 24,
        "temperature": 0.0,
    }
    r = client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    return sentence, str(r.json()["choices"][0]["message"]["content"])


@pytest.fixture(scope="module")
def drilled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Drilled]:
    work = tmp_path_factory.mktemp("console-stack")
    shots = tmp_path_factory.mktemp("console-screenshots")
    print(f"console screenshots: {shots}")
    (work / "data").mkdir()
    env = {**os.environ, "KVGUARD_MODE": "development"}
    stack = drillstack.drill_stack(work / "data", env, model=BUNDLED_MODEL)
    with drillstack.running(stack, work), httpx.Client(base_url=stack.gateway, timeout=120) as c:
        admin = stack.admin()
        a_id, key_a = drillstack.create_tenant(c, admin, "victim-a", sample_rate=1.0)
        b_id, key_b = drillstack.create_tenant(c, admin, "requester-b")
        act = drillstack.play(c, drillstack.DRILL, drillstack.DRILL_MODEL, key_a, key_b)
        assert act.b.codes == (drillstack.CUT_CODE,) and not act.b.marker_seen, act
        finding = _until(
            lambda: drillstack.finding_for(c, admin, act.b.request_id), "the leak's finding"
        )
        assert drillstack.quarantine_of(c, admin, drillstack.DRILL) is not None
        assert echo_probe(stack, drillstack.GUARDED_MODEL).passed
        sentence, answer = _own_chat(c, key_a)
        texts = (sentence, answer) if len(answer.strip()) >= 12 else (sentence,)
        yield Drilled(stack, act, finding, a_id, b_id, key_a, texts, shots)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as playwright:
        launched = launch_chromium(playwright)
        try:
            yield launched
        finally:
            launched.close()


@dataclass
class Operator:
    page: Page
    problems: list[str]  # the CSP violations and script errors the browser reported


@pytest.fixture
def operator(drilled: Drilled, browser: Browser) -> Iterator[Operator]:
    """A fresh browser context (no cookies), signed in through the form."""
    context = browser.new_context(base_url=drilled.url, viewport={"width": 1360, "height": 900})
    page = context.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if "Security Policy" in m.text else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("dialog", lambda dialog: dialog.accept())  # the console's confirm() prompts
    page.goto("/console")
    page.wait_for_url("**/console/login")
    _shot(drilled, page, "login")
    page.fill("#token", drilled.stack.admin_token)
    page.click("button[type=submit]")
    page.wait_for_url("**/console")
    try:
        yield Operator(page, problems)
    finally:
        context.close()
    assert problems == []  # no CSP violation, no script error on any page


def _shot(drilled: Drilled, page: Page, name: str) -> None:
    path = drilled.shots / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    if name == "isolation" and os.environ.get(SHOT_ENV):
        shutil.copy(path, os.environ[SHOT_ENV])


def test_operator_sees_the_leak_and_clears_the_quarantine(
    drilled: Drilled, operator: Operator
) -> None:
    page, finding = operator.page, drilled.finding
    engine = page.locator("#engine-drill")
    expect(engine).to_contain_text("quarantined")
    expect(engine).to_contain_text(f"by finding #{finding['id']}")
    expect(engine).to_contain_text("since 20")
    row = page.locator(f"#finding-{finding['id']}")
    for text in (
        "cross-tenant",
        "critical",
        "confirmed",
        drilled.tenant_a,  # the victim
        drilled.tenant_b,  # the requesting tenant
        str(drilled.act.b.request_id),
        str(drilled.act.a.request_id),
        "cut quarantined",
    ):
        expect(row).to_contain_text(text)
    expect(page.locator("#probes")).to_contain_text("echo")
    expect(page.locator("#probes")).to_contain_text("pass")
    expect(page.locator("#cuts-caption")).to_contain_text("1 cut in the last 24 hours")
    expect(page.locator("#cuts-chart rect")).to_have_count(1)  # one bar: the hour of the cut
    _shot(drilled, page, "isolation")

    page.click("nav >> text=Engines")
    page.wait_for_url("**/console/engines")
    _shot(drilled, page, "engines")
    reason = "drill replayed on purpose; decode checks restored"
    page.fill("#engine-drill form.clear-quarantine input[name=reason]", reason)
    page.click("#engine-drill form.clear-quarantine button")
    page.wait_for_url("**/console/engines?note=cleared")
    expect(page.locator(".note")).to_contain_text("Quarantine cleared")
    latest = page.locator("#actions tbody tr").first
    for text in ("engine.clear_quarantine", "drill", "console", reason):
        expect(latest).to_contain_text(text)
    with httpx.Client(base_url=drilled.url, timeout=30) as client:
        assert drillstack.quarantine_of(client, drilled.stack.admin(), drillstack.DRILL) is None
    _until(
        lambda: drillstack.DRILL in drillstack.routable(drilled.url, drilled.stack.admin()),
        "drill routable again",
    )
    page.click("nav >> text=Isolation now")
    expect(page.locator("#engine-drill")).to_contain_text("routable")


def test_tenant_and_key_made_in_the_console_serve_and_are_refused_once_revoked(
    drilled: Drilled, operator: Operator
) -> None:
    page = operator.page
    page.goto("/console/tenants")
    expect(page.locator("#tenant-" + drilled.tenant_b)).to_contain_text("isolation_violation")
    page.fill("#create-tenant input[name=name]", "made-in-console")
    page.fill("#create-tenant input[name=requests_per_minute]", "600")
    page.click("#create-tenant button")
    expect(page.locator("h1")).to_contain_text("Tenant created")
    key = page.inner_text("#new-key").strip()
    assert key.startswith("kvg_")
    _shot(drilled, page, "key-shown-once")

    with httpx.Client(base_url=drilled.url, timeout=60) as client:
        auth = {"Authorization": f"Bearer {key}"}
        assert client.get("/v1/models", headers=auth).status_code == 200
        body = {
            "model": drillstack.GUARDED_MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
        }
        assert client.post("/v1/chat/completions", json=body, headers=auth).status_code == 200

        page.click("text=Back to the tenant")
        expect(page.locator("#keys")).to_contain_text("live")
        _shot(drilled, page, "tenant")
        prefix = key.split("_")[1]
        page.click(f"#key-{prefix} button")
        page.wait_for_url("**?note=revoked")
        expect(page.locator(f"#key-{prefix}")).to_contain_text("revoked")
        refused = client.get("/v1/models", headers=auth)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert "revoked" in refused.json()["error"]["message"]

        usage = _until(
            lambda: (u := _usage(client, drilled, "made-in-console"))["requests"] and u,
            "the chat's audit row",
        )
    page.goto("/console/tenants")
    made = page.locator("tr", has_text="made-in-console")
    expect(made).to_contain_text("600")
    expect(made.locator("td.num").nth(4)).to_have_text(str(usage["requests"]))
    expect(made.locator("td.num").nth(5)).to_contain_text(str(usage["prompt_tokens"]))
    _shot(drilled, page, "tenants")


def _usage(client: httpx.Client, drilled: Drilled, ref: str) -> dict[str, Any]:
    r = client.get(f"/admin/tenants/{ref}/usage", headers=drilled.stack.admin())
    assert r.status_code == 200, r.text
    return r.json()


class _Attacker(BaseHTTPRequestHandler):
    """A page on another origin whose form posts to the console (the operator clicks it)."""

    page = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(self.page)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def attacker(drilled: Drilled) -> Iterator[int]:
    _Attacker.page = (
        f'<form method="post" action="{drilled.url}/console/tenants">'
        '<input name="name" value="forged-tenant"><input name="csrf" value="guess">'
        '<button id="go">win a prize</button></form>'
    ).encode()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Attacker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()


@pytest.mark.parametrize(
    ("host", "status"),
    [("localhost", 401), ("127.0.0.1", 403)],
    ids=["cross-site: no cookie", "same-site, cross-origin: origin refused"],
)
def test_a_form_posted_from_another_origin_is_refused(
    drilled: Drilled, operator: Operator, attacker: int, host: str, status: int
) -> None:
    page = operator.page
    with page.expect_response(lambda r: r.url.endswith("/console/tenants")) as answer:
        page.goto(f"http://{host}:{attacker}/")
        page.click("#go")
    assert answer.value.status == status
    with httpx.Client(base_url=drilled.url, timeout=30) as client:
        names = [
            t["name"] for t in client.get("/admin/tenants", headers=drilled.stack.admin()).json()
        ]
    assert "forged-tenant" not in names


def test_every_console_route_refuses_callers_without_a_session(drilled: Drilled) -> None:
    routes = console_routes(create_app(GatewaySettings()))
    assert len(routes) >= 10
    values = {
        "tenant_id": drilled.tenant_a,
        "prefix": drilled.key_a.split("_")[1],
        "name": "guarded",
    }
    callers = {
        "nobody": {},
        "tenant key": {"Authorization": f"Bearer {drilled.key_a}"},
        "admin token as bearer": {"Authorization": f"Bearer {drilled.stack.admin_token}"},
        "forged cookie": {"Cookie": "kvguard_console=" + drilled.stack.admin_token},
    }
    with httpx.Client(base_url=drilled.url, timeout=30) as client:
        for method, template in routes:
            path = template.format(**values)
            for who, headers in callers.items():
                r = client.request(method, path, headers=headers, data={"name": "x", "csrf": ""})
                if method == "GET":
                    assert (r.status_code, r.headers.get("location")) == (303, "/console/login"), (
                        who,
                        method,
                        path,
                    )
                else:
                    assert r.status_code == 401, (who, method, path, r.status_code)
        key = client.get("/v1/models", headers={"Authorization": f"Bearer {drilled.key_a}"})
        assert key.status_code == 200  # nothing was revoked or changed on the way


def test_no_page_or_asset_holds_a_prompt_marker_or_answer(drilled: Drilled) -> None:
    with httpx.Client(base_url=drilled.url, timeout=30) as client:
        served = [client.get("/console/login")]  # before signing in (then it redirects)
        sign_in(client, drilled.stack.admin_token)
        pages = ["/console", "/console/tenants", "/console/engines"]
        pages += [f"/console/tenants/{t}?window=all" for t in (drilled.tenant_a, drilled.tenant_b)]
        pages += ["/console/static/console.css", "/console/static/console.js"]
        pages += ["/console/static/favicon.svg"]
        prompt_run = "x" * 40  # drillstack's prompts are runs of "x"
        served += [client.get(path) for path in pages]
        for r in served:
            path = r.url.path
            assert r.status_code == 200, (path, r.status_code)
            assert MARKER_PIECE_RE.search(r.text) is None, path
            assert "CNRY" not in r.text, path
            assert prompt_run not in r.text, path
            for text in drilled.texts:
                assert text not in r.text, (path, text)
        # the pages did show the drill: this is not an empty console passing by default
        assert drilled.finding["victim_request_id"] in client.get("/console").text
