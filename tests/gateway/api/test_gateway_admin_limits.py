"""Admin limits and declared sizes are held to what their columns hold (issue 32, finding 4): on
PostgreSQL a limit between 2**31 and 2**40 used to pass validation and fail in the database's
int4 column (500). Now: a 400 naming the field, before any write; the largest value that fits is
stored and read back. Real PostgreSQL (a private server started by the test session)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from gateway_harness import Gateway, running_gateway

from gateway.config import GatewaySettings
from gateway.db.models import INTEGER_MAX

LIMITS = ("requests_per_minute", "tokens_per_minute", "max_concurrency", "max_context_tokens")


@pytest.fixture
async def pg_gateway(
    make_settings: Callable[..., GatewaySettings], postgres_url: str
) -> AsyncIterator[Gateway]:
    async with running_gateway(make_settings(database_url=postgres_url)) as gw:
        yield gw


@pytest.mark.parametrize("field", LIMITS)
async def test_a_limit_the_column_cannot_hold_is_a_400_naming_it(
    pg_gateway: Gateway, field: str
) -> None:
    gw = pg_gateway
    for value in (INTEGER_MAX + 1, 2**40):
        created = await gw.client.post(
            "/admin/tenants", json={"name": "big", field: value}, headers=gw.admin
        )
        assert created.status_code == 400, created.text
        error = created.json()["error"]
        assert (error["param"], error["code"]) == (field, "invalid_request")
        assert field in error["message"]
    tenant, _ = await gw.create_tenant("fits", **{field: INTEGER_MAX})
    patched = await gw.client.patch(
        f"/admin/tenants/{tenant}", json={field: INTEGER_MAX + 1}, headers=gw.admin
    )
    assert (patched.status_code, patched.json()["error"]["param"]) == (400, field)
    got = await gw.client.get(f"/admin/tenants/{tenant}", headers=gw.admin)
    assert got.json()[field] == INTEGER_MAX


async def test_declared_engine_sizes_are_held_to_their_columns(pg_gateway: Gateway) -> None:
    gw = pg_gateway
    engine: dict[str, Any] = {
        "name": "declared",
        "kind": "openai",
        "base_url": "http://127.0.0.1:9",
        "model": "m",
        "declared_max_model_len": INTEGER_MAX + 1,
    }
    r = await gw.client.post("/admin/engines", json=engine, headers=gw.admin)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "declared_max_model_len")


def test_the_admin_cli_refuses_the_same_limits(capsys: pytest.CaptureFixture[str]) -> None:
    from kvguard.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["admin", "tenant", "set-limits", "acme", "--rpm", str(INTEGER_MAX + 1)])
    assert exited.value.code == 2
    assert f"a limit is an integer in 1..{INTEGER_MAX} or 'none'" in capsys.readouterr().err
