"""The operator's actions (``gateway.services.operator``): the admin API and the console run
the same code and leave the same record, on a real gateway app with SQLite.

Proves: each change made through the admin API records one ``admin_actions`` row (channel
``admin_api``) naming its target and what changed, never a key (the console's actions record the
same rows under ``console``: ``tests/gateway/console/test_console_actions.py``); clearing a
quarantine keeps the operator's reason and commits with its record or not at all;
``PUT /admin/engines/{name}/members`` replaces a registered group's members (validated like a
registration) and refuses engines from settings.
"""

from __future__ import annotations

import pytest
from gateway_harness import Gateway
from sqlalchemy import select, text

from contracts.sql import session_scope
from gateway.db.models import AdminAction, EngineControl

GROUP = {
    "name": "group",
    "kind": "sglang",
    "base_url": "http://127.0.0.1:9",
    "members": [{"name": "p0", "role": "prefill", "url": "http://127.0.0.1:9"}],
}


def _actions(gateway: Gateway) -> list[tuple[str, str, str, str | None, str | None]]:
    with session_scope(gateway.state.sessions) as session:
        rows = session.scalars(select(AdminAction).order_by(AdminAction.id)).all()
        return [(r.channel, r.action, r.target, r.detail, r.reason) for r in rows]


async def test_admin_api_changes_are_recorded_without_secrets(gateway: Gateway) -> None:
    admin, client = gateway.admin, gateway.client
    tenant_id, key = await gateway.create_tenant("acme", requests_per_minute=60)
    r = await client.patch(
        f"/admin/tenants/{tenant_id}",
        json={"status": "disabled", "tokens_per_minute": 1000, "max_concurrency": None},
        headers=admin,
    )
    assert r.status_code == 200, r.text
    issued = (await client.post(f"/admin/tenants/{tenant_id}/keys", json={}, headers=admin)).json()
    r = await client.post(f"/admin/keys/{issued['prefix']}/revoke", headers=admin)
    assert r.status_code == 200
    r = await client.post("/admin/engines", json=GROUP, headers=admin)
    assert r.status_code == 201, r.text
    r = await client.post(
        "/admin/engines/group/quarantine", json={"reason": "drill"}, headers=admin
    )
    assert r.status_code == 200
    r = await client.request(
        "DELETE", "/admin/engines/group/quarantine", json={"reason": "fixed"}, headers=admin
    )
    assert r.status_code == 200 and r.json()["quarantine_reason"] is None
    r = await client.delete("/admin/engines/group/quarantine", headers=admin)  # no reason: allowed
    assert r.status_code == 200
    first_prefix = key.split("_")[1]
    assert _actions(gateway) == [
        (
            "admin_api",
            "tenant.create",
            tenant_id,
            f"name=acme; first key {first_prefix}; requests_per_minute=60",
            None,
        ),
        (
            "admin_api",
            "tenant.update",
            tenant_id,
            "status=disabled; tokens_per_minute=1000; max_concurrency=none",
            None,
        ),
        ("admin_api", "key.issue", issued["prefix"], f"tenant {tenant_id}", None),
        ("admin_api", "key.revoke", issued["prefix"], f"tenant {tenant_id}", None),
        (
            "admin_api",
            "engine.register",
            "group",
            "kind=sglang; base_url=http://127.0.0.1:9; members=1",
            None,
        ),
        ("admin_api", "engine.quarantine", "group", None, "drill"),
        ("admin_api", "engine.clear_quarantine", "group", "was: drill", "fixed"),
        ("admin_api", "engine.clear_quarantine", "group", "was: not quarantined", None),
    ]
    assert not any(key in str(row) or issued["key"] in str(row) for row in _actions(gateway))


async def test_a_clear_and_its_record_commit_together(gateway: Gateway) -> None:
    r = await gateway.client.post("/admin/engines", json=GROUP, headers=gateway.admin)
    assert r.status_code == 201
    await gateway.state.quarantines.impose("group", reason="drill")

    def fails(session) -> None:
        raise RuntimeError("the record could not be written")

    with pytest.raises(RuntimeError):
        await gateway.state.quarantines.clear("group", also=fails)
    with session_scope(gateway.state.sessions) as session:
        row = session.get(EngineControl, "group")
        assert row is not None and row.quarantine_reason == "drill"  # not lifted without it
    assert gateway.state.registry.get("group").controls.quarantine_reason == "drill"


async def test_members_of_a_registered_group_are_replaced_and_validated(
    gateway: Gateway,
) -> None:
    admin, client = gateway.admin, gateway.client
    assert (await client.post("/admin/engines", json=GROUP, headers=admin)).status_code == 201
    members = [
        {"name": "p1", "role": "prefill", "url": "http://127.0.0.1:10"},
        {"name": "d1", "role": "decode", "url": "http://127.0.0.1:11"},
    ]
    r = await client.put("/admin/engines/group/members", json={"members": members}, headers=admin)
    assert r.status_code == 200, r.text
    assert [(m["name"], m["role"]) for m in r.json()["members"]] == [
        ("p1", "prefill"),
        ("d1", "decode"),
    ]
    bad = [{"name": "p1", "role": "prefill", "url": "ftp://nowhere"}]
    r = await client.put("/admin/engines/group/members", json={"members": bad}, headers=admin)
    assert r.status_code == 400 and r.json()["error"]["param"] == "members", r.text
    r = await client.put("/admin/engines/standin/members", json={"members": []}, headers=admin)
    assert r.status_code == 404 and "configured engines change in settings" in r.text


async def test_a_quarantine_stands_when_its_record_cannot_be_written(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    """Tightening isolation never waits on the audit: the database refuses the record (its table
    is gone), the quarantine holds on this replica and in the database, and the log says so."""
    with session_scope(gateway.state.sessions) as session:
        session.execute(text("DROP TABLE admin_actions"))
    r = await gateway.client.post(
        "/admin/engines/standin/quarantine", json={"reason": "suspicious"}, headers=gateway.admin
    )
    assert r.status_code == 200 and r.json()["quarantine_reason"] == "suspicious", r.text
    with session_scope(gateway.state.sessions) as session:
        row = session.get(EngineControl, "standin")
        assert row is not None and row.quarantine_reason == "suspicious"
    assert "quarantine of standin imposed; its admin action not recorded" in caplog.text
    # clearing, which relaxes isolation, is refused without its record: nothing is lifted
    r = await gateway.client.delete("/admin/engines/standin/quarantine", headers=gateway.admin)
    assert r.status_code == 503, r.text
    assert gateway.state.registry.get("standin").controls.quarantine_reason == "suspicious"
