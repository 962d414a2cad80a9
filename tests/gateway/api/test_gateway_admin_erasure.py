"""``DELETE /admin/tenants/{ref}/responses``: an operator erases every stored response of one
tenant (an erasure request), on PostgreSQL as in production.

Proves: the admin token alone may erase (no token, a wrong one and the tenant's own key get the
admin API's 401 and erase nothing); the answer counts what went; only that tenant's responses go
(retrieve and continue answer 404 at once, another tenant's response is untouched in the
database); the tenant and its keys stay; each erasure is one ``admin_actions`` row; an unknown
tenant is the admin API's usual 404.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
from gateway_harness import Gateway, bearer, running_gateway
from gateway_standin import StandInEngine
from sqlalchemy import select

from contracts.sql import session_scope
from gateway.config import GatewaySettings
from gateway.db.models import AdminAction, StoredResponse


@pytest.fixture
async def pg_gateway(
    make_settings: Callable[..., GatewaySettings], postgres_url: str, standin: StandInEngine
) -> AsyncIterator[Gateway]:
    engines = [{"name": "standin", "kind": "bundled", "base_url": standin.url}]
    async with running_gateway(make_settings(database_url=postgres_url, engines=engines)) as gw:
        yield gw


async def _stored(gw: Gateway, key: str, text: str) -> str:
    listed = await gw.client.get("/v1/models", headers=bearer(key))
    body = {"model": listed.json()["data"][0]["id"], "input": text, "max_output_tokens": 16}
    created = await gw.client.post("/v1/responses", headers=bearer(key), json=body)
    assert created.status_code == 200, created.text
    return str(created.json()["id"])


def _owners(gw: Gateway) -> list[str]:
    with session_scope(gw.state.sessions) as session:
        return list(session.scalars(select(StoredResponse.tenant_id)))


def _recorded(gw: Gateway) -> list[tuple[str, str, str, str | None]]:
    with session_scope(gw.state.sessions) as session:
        query = select(AdminAction).where(AdminAction.action == "tenant.erase_responses")
        rows = session.scalars(query.order_by(AdminAction.id))
        return [(r.channel, r.action, r.target, r.detail) for r in rows]


async def test_an_erasure_deletes_that_tenants_responses_only(pg_gateway: Gateway) -> None:
    gw = pg_gateway
    id_a, key_a = await gw.create_tenant("tenant-a")
    id_b, key_b = await gw.create_tenant("tenant-b")
    erased_ids = [await _stored(gw, key_a, f"tenant A's turn {n}") for n in (1, 2)]
    kept_id = await _stored(gw, key_b, "tenant B's turn")
    path = f"/admin/tenants/{id_a}/responses"

    for headers in ({}, bearer("wrong"), bearer(key_a)):
        refused = await gw.client.delete(path, headers=headers)
        assert (refused.status_code, refused.json()["error"]["code"]) == (401, "invalid_api_key")
    assert sorted(_owners(gw)) == sorted([id_a, id_a, id_b])

    erased = await gw.client.delete("/admin/tenants/tenant-a/responses", headers=gw.admin)
    assert (erased.status_code, erased.json()) == (200, {"tenant_id": id_a, "erased": 2})
    assert _owners(gw) == [id_b]
    for response_id in erased_ids:
        gone = await gw.client.get(f"/v1/responses/{response_id}", headers=bearer(key_a))
        assert (gone.status_code, gone.json()["error"]["code"]) == (404, "not_found")
    listed = await gw.client.get("/v1/models", headers=bearer(key_a))  # the tenant stays
    assert listed.status_code == 200, listed.text
    go_on = {"model": listed.json()["data"][0]["id"], "input": "go on"}
    go_on["previous_response_id"] = erased_ids[0]
    resumed = await gw.client.post("/v1/responses", headers=bearer(key_a), json=go_on)
    assert resumed.status_code == 404, resumed.text
    kept = await gw.client.get(f"/v1/responses/{kept_id}", headers=bearer(key_b))
    assert kept.status_code == 200, kept.text

    again = await gw.client.delete(path, headers=gw.admin)
    assert (again.status_code, again.json()) == (200, {"tenant_id": id_a, "erased": 0})
    assert _recorded(gw) == [
        ("admin_api", "tenant.erase_responses", id_a, "2 stored responses erased"),
        ("admin_api", "tenant.erase_responses", id_a, "0 stored responses erased"),
    ]


async def test_an_unknown_tenant_is_the_usual_404(pg_gateway: Gateway) -> None:
    gw = pg_gateway
    missing = await gw.client.delete("/admin/tenants/nobody/responses", headers=gw.admin)
    usual = await gw.client.get("/admin/tenants/nobody", headers=gw.admin)
    assert (missing.status_code, missing.json()) == (404, usual.json())
    assert missing.json()["error"]["code"] == "tenant_not_found"
    assert _recorded(gw) == []
