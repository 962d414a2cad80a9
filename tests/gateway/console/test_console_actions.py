"""The console's actions run the admin API's code (``gateway.services.operator``) and leave the
same record under the channel ``console``; on a real gateway app with SQLite.

Proves: creating a tenant, setting its limits and canary rate, disabling it, issuing a key with an
expiry, revoking it, registering a group, replacing its members and clearing a quarantine with a
reason each change exactly what the admin API would (read back through the admin API) and record
one ``admin_actions`` row naming the channel ``console``; the issued key is shown once and never
recorded; a quarantine is not cleared without a reason; erasing a tenant's stored responses
deletes its own and nobody else's, and the tenant page shows how many went.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from console_harness import async_sign_in
from gateway_harness import Gateway
from sqlalchemy import select

from contracts.sql import session_scope, utcnow
from gateway.db.models import AdminAction, StoredResponse
from gateway.responses.objects import new_id
from gateway.services import responses as store

GROUP = {
    "name": "group",
    "kind": "sglang",
    "base_url": "http://127.0.0.1:9",
    "members": [{"name": "p0", "role": "prefill", "url": "http://127.0.0.1:9"}],
}


@pytest.fixture
async def console(gateway: Gateway) -> AsyncIterator[tuple[httpx.AsyncClient, str]]:
    transport = httpx.ASGITransport(app=gateway.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        yield client, await async_sign_in(client, gateway.state.settings.admin_secret())


def _console_actions(gateway: Gateway) -> list[tuple[str, str, str | None, str | None]]:
    with session_scope(gateway.state.sessions) as session:
        query = select(AdminAction).where(AdminAction.channel == "console").order_by(AdminAction.id)
        return [(r.action, r.target, r.detail, r.reason) for r in session.scalars(query)]


async def _admin(gateway: Gateway, path: str) -> Any:
    r = await gateway.client.get(path, headers=gateway.admin)
    assert r.status_code == 200, r.text
    return r.json()


async def test_tenant_and_key_actions(gateway: Gateway, console) -> None:
    client, csrf = console
    r = await client.post(
        "/console/tenants",
        data={"csrf": csrf, "name": "acme", "requests_per_minute": "60", "key_name": "first"},
    )
    assert r.status_code == 200 and "shown only once" in r.text
    first_key = re.search(r'id="new-key">(kvg_[0-9a-f_]+)<', r.text)
    assert first_key is not None
    tenant = await _admin(gateway, "/admin/tenants/acme")
    assert tenant["requests_per_minute"] == 60
    r = await client.post(
        f"/console/tenants/{tenant['id']}/limits",
        data={
            "csrf": csrf,
            "requests_per_minute": "",
            "tokens_per_minute": "1,000",
            "max_concurrency": "4",
            "max_context_tokens": "",
            "canary_sample_rate": "0.25",
        },
    )
    assert (r.status_code, r.headers["location"]) == (
        303,
        f"/console/tenants/{tenant['id']}?note=limits",
    )
    tenant = await _admin(gateway, "/admin/tenants/acme")
    assert (tenant["requests_per_minute"], tenant["tokens_per_minute"]) == (None, 1000)
    assert (tenant["max_concurrency"], tenant["canary_sample_rate"]) == (4, 0.25)
    r = await client.post(
        f"/console/tenants/{tenant['id']}/keys", data={"csrf": csrf, "expires_in_days": "2"}
    )
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    second = re.search(r'id="new-key">kvg_([0-9a-f]+)_', r.text)
    assert second is not None
    keys = await _admin(gateway, f"/admin/tenants/{tenant['id']}/keys")
    assert [k["expires_at"] is not None for k in keys] == [False, True]
    r = await client.post(f"/console/keys/{second.group(1)}/revoke", data={"csrf": csrf})
    assert r.headers["location"] == f"/console/tenants/{tenant['id']}?note=revoked"
    r = await client.post(
        f"/console/tenants/{tenant['id']}/status", data={"csrf": csrf, "status": "disabled"}
    )
    assert r.status_code == 303
    assert (await _admin(gateway, "/admin/tenants/acme"))["status"] == "disabled"
    recorded = _console_actions(gateway)
    assert [(action, target) for action, target, _, _ in recorded] == [
        ("tenant.create", tenant["id"]),
        ("tenant.update", tenant["id"]),
        ("key.issue", second.group(1)),
        ("key.revoke", second.group(1)),
        ("tenant.update", tenant["id"]),
    ]
    assert recorded[1][2] == (
        "requests_per_minute=none; tokens_per_minute=1000; max_concurrency=4; "
        "max_context_tokens=none; canary_sample_rate=0.25"
    )
    assert recorded[4][2] == "status=disabled"
    assert not any(first_key.group(1) in str(row) for row in recorded)


async def test_engine_actions(gateway: Gateway, console) -> None:
    client, csrf = console
    r = await client.post(
        "/console/engines",
        data={
            "csrf": csrf,
            "name": "group",
            "kind": "sglang",
            "base_url": "http://127.0.0.1:9",
            "members": "p0 prefill http://127.0.0.1:9",
        },
    )
    assert (r.status_code, r.headers["location"]) == (303, "/console/engines?note=registered")
    r = await client.post(
        "/console/engines/group/members",
        data={
            "csrf": csrf,
            "members": "p1 prefill http://127.0.0.1:10\nd1 decode http://127.0.0.1:11",
        },
    )
    assert r.status_code == 303, r.text
    engines = await _admin(gateway, "/admin/engines")
    group = next(e for e in engines if e["name"] == "group")
    assert [(m["name"], m["role"]) for m in group["members"]] == [
        ("p1", "prefill"),
        ("d1", "decode"),
    ]
    r = await client.post(
        "/console/engines/group/members", data={"csrf": csrf, "members": "p1 prefill"}
    )
    assert r.status_code == 400 and "expected &#39;name role url&#39;" in r.text
    await gateway.state.quarantines.impose("group", reason="drill")
    r = await client.post("/console/engines/group/clear", data={"csrf": csrf, "reason": "  "})
    assert r.status_code == 400 and "say why" in r.text
    assert gateway.state.registry.get("group").controls.quarantine_reason == "drill"
    r = await client.post("/console/engines/group/clear", data={"csrf": csrf, "reason": "fixed"})
    assert r.status_code == 303
    assert gateway.state.registry.get("group").controls.quarantine_reason is None
    assert _console_actions(gateway) == [
        ("engine.register", "group", "kind=sglang; base_url=http://127.0.0.1:9; members=1", None),
        (
            "engine.members",
            "group",
            "p1 prefill http://127.0.0.1:10, d1 decode http://127.0.0.1:11",
            None,
        ),
        ("engine.clear_quarantine", "group", "was: drill", "fixed"),
    ]
    page = (await client.get("/console/engines")).text
    assert "engine.clear_quarantine" in page and "fixed" in page


def _store_responses(gateway: Gateway, tenant_id: str, count: int) -> None:
    with session_scope(gateway.state.sessions) as session:
        for _ in range(count):
            response = {"id": new_id("resp"), "status": "completed", "output": []}
            store.save(
                session,
                tenant_id=tenant_id,
                response=response,
                history=[],
                input_items=[],
                now=utcnow(),
            )


async def test_erasing_a_tenants_stored_responses(gateway: Gateway, console) -> None:
    client, csrf = console
    tenant_id, _ = await gateway.create_tenant("acme")
    other_id, _ = await gateway.create_tenant("other")
    _store_responses(gateway, tenant_id, 2)
    _store_responses(gateway, other_id, 1)
    page = await client.get(f"/console/tenants/{tenant_id}")
    assert f'action="/console/tenants/{tenant_id}/responses/erase"' in page.text
    r = await client.post(f"/console/tenants/{tenant_id}/responses/erase", data={"csrf": csrf})
    assert (r.status_code, r.headers["location"]) == (
        303,
        f"/console/tenants/{tenant_id}?note=erased",
    )
    with session_scope(gateway.state.sessions) as session:
        assert list(session.scalars(select(StoredResponse.tenant_id))) == [other_id]
    assert _console_actions(gateway) == [
        ("tenant.erase_responses", tenant_id, "2 stored responses erased", None)
    ]
    page = await client.get(r.headers["location"])
    assert "Stored responses erased." in page.text and "2 stored responses erased" in page.text
    assert (await _admin(gateway, "/admin/tenants/acme"))["status"] == "active"
