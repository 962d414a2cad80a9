"""The authorization matrix: every gateway endpoint x every kind of credential.

Attacker: a caller holding the wrong credential for an endpoint -- none, a malformed token, a
well-formed unknown key, a revoked key, a disabled tenant's key, another tenant's key, the metrics
token, the admin token on a tenant route -- and a tenant with a live key that asks for another
tenant's data by every parameter it can think of (``tenant_id``, ``tenant``, ``victim_tenant_id``)
or looks for it in ``/metrics`` and ``/health``.

Proves, against the real gateway (with the canary's routes, as ``kvguard gateway`` serves it) on
127.0.0.1 with PostgreSQL and Redis: tenant endpoints accept only live tenant keys (a disabled
tenant's gets 403 ``tenant_disabled``, everything else 401 ``invalid_api_key``, the admin token
included), admin endpoints only the admin token, the operator console's routes no bearer
credential at all (its own session signs in: ``tests/gateway/console``; every caller here, the
admin token included, is sent to its sign-in page or gets its 401), ``/metrics`` (every
tenant's series) only the metrics or the admin token, public endpoints anything; every wrong
credential is refused before it changes anything (each rightful call afterwards still gets its
expected status); a tenant endpoint answers about the caller's own tenant only (tenant B, asking
for A's usage and findings, gets its own account with zero requests and an empty list; A's
finding does not name the observer; no tenant endpoint's answer to B names A), and neither a
refused ``/metrics`` nor ``/health`` names a tenant. The endpoint list comes from the app's own
routes: an endpoint added without a row in ``MATRIX`` fails
``test_every_endpoint_has_a_matrix_row``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute
from hostile_harness import (
    ENGINE_MODEL,
    ServedGateway,
    gateway_settings,
    openai_error,
    served_gateway,
)
from starlette.routing import Route

from canary.findings import NewFinding, store_finding
from canary.kinds import Action, Evidence, FindingKind, FindingSeverity
from contracts.sql import session_scope
from kvguard.testing import EngineProcess

PUBLIC, TENANT, ADMIN, SCRAPE = "public", "tenant", "admin", "scrape"
CONSOLE = "console"  # a console session only: every bearer credential is refused
THROWAWAY_ENGINE = "matrix-engine"
METRICS_TOKEN = "matrix-metrics-token-" + "m" * 32


@dataclass(frozen=True)
class Call:
    """One endpoint: who may call it, a request that is valid for that caller, its status."""

    kind: str
    status: int  # what the rightful caller gets for this request
    json: dict[str, Any] | None = None
    params: dict[str, Any] = field(default_factory=dict)


def _chat() -> dict[str, Any]:
    return {"model": ENGINE_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


# Order matters for the admin calls that change state: the throwaway engine is registered first
# and removed last; the throwaway tenant's key is revoked after everything else used it.
MATRIX: dict[tuple[str, str], Call] = {
    ("GET", "/health"): Call(PUBLIC, 200),
    ("GET", "/metrics"): Call(SCRAPE, 200),
    ("GET", "/openapi.json"): Call(PUBLIC, 200),
    ("GET", "/docs"): Call(PUBLIC, 200),
    ("GET", "/docs/oauth2-redirect"): Call(PUBLIC, 200),
    ("GET", "/redoc"): Call(PUBLIC, 200),
    ("GET", "/v1/models"): Call(TENANT, 200),
    ("GET", "/v1/models/{model}"): Call(TENANT, 200),
    ("POST", "/v1/chat/completions"): Call(TENANT, 200, json=_chat()),
    (
        "POST",
        "/v1/completions",
    ): Call(TENANT, 200, json={"model": ENGINE_MODEL, "prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/responses"): Call(
        TENANT, 200, json={"model": ENGINE_MODEL, "input": "hi", "max_output_tokens": 16}
    ),
    # No stored response has this id (it was never issued): the tenant reaches the lookup (404,
    # the same answer another tenant's id gets), nobody else does.
    ("GET", "/v1/responses/{response_id}"): Call(TENANT, 404),
    ("DELETE", "/v1/responses/{response_id}"): Call(TENANT, 404),
    ("GET", "/v1/responses/{response_id}/input_items"): Call(TENANT, 404),
    ("POST", "/v1/responses/{response_id}/cancel"): Call(TENANT, 404),
    # The engine serves no embeddings: a tenant reaches the 404 naming model and endpoint.
    ("POST", "/v1/embeddings"): Call(TENANT, 404, json={"model": ENGINE_MODEL, "input": "hi"}),
    ("GET", "/v1/usage"): Call(TENANT, 200),
    ("GET", "/v1/canary/findings"): Call(TENANT, 200),
    ("POST", "/admin/tenants"): Call(ADMIN, 201, json={"name": "matrix-new"}),
    ("GET", "/admin/tenants"): Call(ADMIN, 200),
    ("GET", "/admin/tenants/{ref}"): Call(ADMIN, 200),
    ("PATCH", "/admin/tenants/{ref}"): Call(ADMIN, 200, json={"requests_per_minute": 1000}),
    ("POST", "/admin/tenants/{ref}/keys"): Call(ADMIN, 201, json={"name": "extra"}),
    ("GET", "/admin/tenants/{ref}/keys"): Call(ADMIN, 200),
    ("GET", "/admin/tenants/{ref}/usage"): Call(ADMIN, 200),
    ("DELETE", "/admin/tenants/{ref}/responses"): Call(ADMIN, 200),
    ("GET", "/admin/engines"): Call(ADMIN, 200),
    (
        "POST",
        "/admin/engines",
    ): Call(
        ADMIN,
        201,
        json={
            "name": THROWAWAY_ENGINE,
            "kind": "openai",
            "base_url": "http://127.0.0.1:9",
            "model": "matrix-model",
            "declared_max_model_len": 64,
        },
    ),
    ("PUT", "/admin/engines/{name}/override"): Call(ADMIN, 200, json={"allow_unsafe": False}),
    ("PUT", "/admin/engines/{name}/members"): Call(ADMIN, 200, json={"members": []}),
    ("POST", "/admin/engines/{name}/quarantine"): Call(ADMIN, 200, json={"reason": "matrix"}),
    ("DELETE", "/admin/engines/{name}/quarantine"): Call(ADMIN, 200),
    ("DELETE", "/admin/engines/{name}"): Call(ADMIN, 204),
    ("GET", "/admin/canary/findings"): Call(ADMIN, 200),
    # No finding exists in this world: the admin reaches the lookup (404), nobody else does.
    ("GET", "/admin/canary/findings/{finding_id}"): Call(ADMIN, 404),
    ("GET", "/admin/canary/probe-runs"): Call(ADMIN, 200),
    (
        "POST",
        "/admin/canary/probe-runs",
    ): Call(
        ADMIN,
        201,
        json={
            "run_id": "matrix",
            "results": [
                {
                    "kind": "echo",
                    "expected": "e",
                    "observed": "o",
                    "passed": True,
                    "duration_ms": 1.0,
                    "started_at": "2026-01-01T00:00:00Z",
                }
            ],
        },
    ),
    ("POST", "/admin/keys/{prefix}/revoke"): Call(ADMIN, 200),
    ("GET", "/console/login"): Call(PUBLIC, 200),
    ("POST", "/console/login"): Call(PUBLIC, 400),  # no form: nothing to sign in with
    ("POST", "/console/logout"): Call(CONSOLE, 401),
    ("GET", "/console"): Call(CONSOLE, 303),
    ("GET", "/console/tenants"): Call(CONSOLE, 303),
    ("POST", "/console/tenants"): Call(CONSOLE, 401),
    ("GET", "/console/tenants/{tenant_id}"): Call(CONSOLE, 303),
    ("POST", "/console/tenants/{tenant_id}/limits"): Call(CONSOLE, 401),
    ("POST", "/console/tenants/{tenant_id}/status"): Call(CONSOLE, 401),
    ("POST", "/console/tenants/{tenant_id}/keys"): Call(CONSOLE, 401),
    ("POST", "/console/tenants/{tenant_id}/responses/erase"): Call(CONSOLE, 401),
    ("POST", "/console/keys/{prefix}/revoke"): Call(CONSOLE, 401),
    ("GET", "/console/engines"): Call(CONSOLE, 303),
    ("POST", "/console/engines"): Call(CONSOLE, 401),
    ("POST", "/console/engines/{name}/members"): Call(CONSOLE, 401),
    ("POST", "/console/engines/{name}/clear"): Call(CONSOLE, 401),
}


@dataclass
class World:
    gateway: ServedGateway
    tenant_a: str
    key_a: str
    tenant_b: str
    key_b: str
    throwaway_tenant: str
    throwaway_prefix: str
    credentials: dict[str, str | None]

    def path(self, template: str) -> str:
        return template.format(
            ref=self.throwaway_tenant,
            tenant_id=self.throwaway_tenant,
            name=THROWAWAY_ENGINE,
            prefix=self.throwaway_prefix,
            finding_id=1,
            model=ENGINE_MODEL,
            response_id="resp_" + "0" * 48,
        )

    def call(self, method: str, template: str, token: str | None, **kw: Any) -> httpx.Response:
        headers = {} if token is None else {"Authorization": f"Bearer {token}"}
        return httpx.request(
            method,
            self.gateway.url + self.path(template),
            headers=headers,
            timeout=60,
            follow_redirects=False,
            **kw,
        )


def _world(gateway: ServedGateway) -> World:
    admin = gateway.settings.admin_secret()
    tenant_a, key_a = gateway.create_tenant("tenant-a")
    tenant_b, key_b = gateway.create_tenant("tenant-b")
    throwaway, _ = gateway.create_tenant("throwaway")
    r = httpx.post(f"{gateway.url}/admin/tenants/{tenant_a}/keys", json={}, headers=gateway.admin)
    revoked = r.json()["key"]
    r = httpx.post(f"{gateway.url}/admin/keys/{r.json()['prefix']}/revoke", headers=gateway.admin)
    assert r.status_code == 200, r.text
    disabled_tenant, disabled_key = gateway.create_tenant("disabled")
    r = httpx.patch(
        f"{gateway.url}/admin/tenants/{disabled_tenant}",
        json={"status": "disabled"},
        headers=gateway.admin,
    )
    assert r.status_code == 200, r.text
    r = httpx.post(f"{gateway.url}/admin/tenants/{throwaway}/keys", json={}, headers=gateway.admin)
    credentials: dict[str, str | None] = {
        "none": None,
        "malformed": "not-a-key",
        "unknown": "kvg_000000000000_" + "0" * 64,
        "revoked": revoked,
        "disabled": disabled_key,
        "other tenant": key_b,
        "metrics": METRICS_TOKEN,
        "admin": admin,
        "own": key_a,
    }
    return World(
        gateway, tenant_a, key_a, tenant_b, key_b, throwaway, r.json()["prefix"], credentials
    )


@pytest.fixture
def world(postgres_url: str, redis_url: str, engine: EngineProcess) -> Iterator[World]:
    settings = gateway_settings(
        postgres_url,
        engine.url,
        redis_url=redis_url,
        metrics_token=METRICS_TOKEN,
        # the matrix tries every wrong credential; the throttles themselves are
        # test_hostile_secrets's and test_hostile_forwarded's
        operator_failures_per_minute=10_000,
        auth_failures_per_minute=10_000,
    )
    with served_gateway(settings) as gateway:
        yield _world(gateway)


def _routes(routes: list[Any], prefix: str = "") -> set[tuple[str, str]]:
    """(method, path) of every route, walking included routers (FastAPI keeps them nested)."""
    found: set[tuple[str, str]] = set()
    for route in routes:
        included = getattr(route, "original_router", None)
        if included is not None:
            found |= _routes(included.routes, prefix + route.include_context.prefix)
        elif isinstance(route, APIRoute | Route):
            path = (prefix + route.path).replace(":path}", "}")  # as the OpenAPI names it
            found |= {(m, path) for m in route.methods or () if m != "HEAD"}
    return found


def test_every_endpoint_has_a_matrix_row(world: World) -> None:
    app = world.gateway.app
    routes = _routes(app.routes)
    documented = {(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops}
    assert documented <= routes  # the walk sees at least what the schema documents
    assert routes == set(MATRIX)


def _refused(response: httpx.Response, status: int, code: str, who: str, where: str) -> None:
    assert response.status_code == status, (who, where, response.status_code, response.text)
    assert openai_error(response)["code"] == code, (who, where)


def _console_refused(response: httpx.Response, status: int, who: str, where: str) -> None:
    assert response.status_code == status, (who, where, response.status_code, response.text)
    if status == 303:
        assert response.headers["location"] == "/console/login", (who, where)


def test_the_matrix(world: World) -> None:
    """Wrong credentials first (they must change nothing), then each rightful caller."""
    for (method, template), call in MATRIX.items():
        where = f"{method} {template}"
        for who, token in world.credentials.items():
            if call.kind == PUBLIC or (call.kind, who) in (
                (TENANT, "own"),
                (TENANT, "other tenant"),
                (ADMIN, "admin"),
                (SCRAPE, "metrics"),
                (SCRAPE, "admin"),
            ):
                continue
            r = world.call(method, template, token, json=call.json, params=call.params)
            if call.kind == CONSOLE:
                _console_refused(r, call.status, who, where)
            elif who == "disabled" and call.kind == TENANT:
                _refused(r, 403, "tenant_disabled", who, where)
            else:
                _refused(r, 401, "invalid_api_key", who, where)
    for (method, template), call in MATRIX.items():
        callers = {
            PUBLIC: list(world.credentials),
            TENANT: ["own", "other tenant"],
            SCRAPE: ["metrics", "admin"],
            CONSOLE: [],  # its rightful caller holds a session, not a credential
        }
        for who in callers.get(call.kind, ["admin"]):
            r = world.call(method, template, world.credentials[who], json=call.json)
            assert r.status_code == call.status, (who, method, template, r.text[:300])


def _until(predicate: Any, timeout_s: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.1)


def test_tenant_endpoints_never_reveal_another_tenants_data(world: World) -> None:
    # tenant A makes traffic (audit rows -> usage) and is the victim of a stored finding
    for _ in range(2):
        r = world.call("POST", "/v1/chat/completions", world.key_a, json=_chat())
        assert r.status_code == 200, r.text
    finding = NewFinding(
        kind=FindingKind.CROSS_TENANT,
        severity=FindingSeverity.CRITICAL,
        evidence=Evidence.CONFIRMED,
        action=Action.CUT,
        observer_tenant_id=world.tenant_b,
        engine="tiny",
        observer_request_id="req-observer",
        victim_tenant_id=world.tenant_a,
        victim_request_id="req-victim-a",
    )
    with session_scope(world.gateway.app.state.gateway.sessions) as session:
        store_finding(session, finding)  # the canary's own store, on the gateway's database

    def usage(key: str, **params: Any) -> dict[str, Any]:
        r = world.call("GET", "/v1/usage", key, params=params)
        assert r.status_code == 200, r.text
        return r.json()

    own = _until(lambda: (u := usage(world.key_a))["requests"] >= 2 and u)
    assert own and own["tenant_id"] == world.tenant_a and own["requests"] == 2
    # B, asking every way it could for A's data, gets its own (empty) account
    for params in ({}, {"tenant_id": world.tenant_a}, {"tenant": world.tenant_a}):
        theirs = usage(world.key_b, **params)
        assert theirs["tenant_id"] == world.tenant_b and theirs["requests"] == 0, params
    r = world.call("GET", "/v1/canary/findings", world.key_a)
    assert [f["victim_request_id"] for f in r.json()] == ["req-victim-a"]
    assert "observer_tenant_id" not in r.json()[0]  # the victim does not learn who received it
    for params in ({}, {"tenant": world.tenant_a}, {"victim_tenant_id": world.tenant_a}):
        r = world.call("GET", "/v1/canary/findings", world.key_b, params=params)
        assert r.status_code == 200 and r.json() == [], (params, r.text)
    # and nothing B can reach on a tenant endpoint names tenant A
    for (method, template), call in MATRIX.items():
        if call.kind == TENANT:
            r = world.call(method, template, world.key_b, json=call.json)
            assert world.tenant_a not in r.text and "tenant-a" not in r.text, template


def test_metrics_and_health_never_reveal_a_tenant_to_a_tenant(world: World) -> None:
    r = world.call("POST", "/v1/chat/completions", world.key_a, json=_chat())
    assert r.status_code == 200, r.text
    # the series exist, per tenant: the scrape credential reads tenant A's id in them
    scraped = world.call("GET", "/metrics", METRICS_TOKEN)
    assert scraped.status_code == 200 and f'tenant="{world.tenant_a}"' in scraped.text
    for who in ("none", "other tenant", "own", "malformed"):
        r = world.call("GET", "/metrics", world.credentials[who])
        _refused(r, 401, "invalid_api_key", who, "GET /metrics")
        assert world.tenant_a not in r.text and "kvguard_" not in r.text, who
        r = world.call("GET", "/health", world.credentials[who])
        assert r.status_code == 200, r.text
        assert world.tenant_a not in r.text and world.tenant_b not in r.text, who
        assert "tenant-a" not in r.text and "tenant-b" not in r.text, who
