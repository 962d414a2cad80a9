"""`kvguard admin ...`: the first key is printed on the last line and works on a gateway started
with the same environment; `tenant erase-responses` deletes one tenant's stored responses (on
PostgreSQL) and nobody else's."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta

from gateway_harness import bearer, running_gateway
from sqlalchemy import select

from contracts.sql import make_session_factory, session_scope, utcnow
from gateway.config import GatewaySettings
from gateway.db.models import StoredResponse
from gateway.db.session import make_engine
from gateway.responses.objects import new_id
from gateway.services import responses as store
from gateway.services.tenants import get_tenant
from kvguard.cli import main


def _run(capsys, *argv: str) -> tuple[int, list[str]]:
    status = main(list(argv))
    captured = capsys.readouterr()
    _run.last_err = captured.err  # type: ignore[attr-defined]
    return status, captured.out.strip().splitlines()


async def test_tenant_create_prints_a_working_key_last(sqlite_url, monkeypatch, capsys) -> None:
    monkeypatch.setenv("KVGUARD_DATABASE_URL", sqlite_url)
    monkeypatch.setenv("KVGUARD_AUTH_CACHE_TTL_S", "0.5")
    status, lines = _run(capsys, "admin", "tenant", "create", "acme", "--rpm", "7")
    assert status == 0
    key = lines[-1]
    assert key.startswith("kvg_") and len(key) == 4 + 12 + 1 + 64

    status, lines = _run(capsys, "admin", "tenant", "list")
    assert status == 0 and '"requests_per_minute": 7' in lines[0] and key not in lines[0]

    async with running_gateway(GatewaySettings()) as gw:
        response = await gw.client.get("/v1/models", headers=bearer(key))
        assert response.status_code == 200, response.text

        status, lines = _run(capsys, "admin", "key", "revoke", key.split("_")[1])
        assert status == 0
        # revoked elsewhere (the CLI): this replica trusts its verified copy for at most the TTL
        past_ttl = utcnow() + timedelta(seconds=0.55)
        gw.state.clock = lambda: past_ttl
        assert (await gw.client.get("/v1/models", headers=bearer(key))).status_code == 401


def test_limits_keys_and_disable(sqlite_url, monkeypatch, capsys) -> None:
    monkeypatch.setenv("KVGUARD_DATABASE_URL", sqlite_url)
    assert _run(capsys, "admin", "tenant", "create", "acme", "--tpm", "100")[0] == 0
    status, lines = _run(
        capsys, "admin", "tenant", "set-limits", "acme", "--tpm", "none", "--concurrency", "2"
    )
    assert status == 0
    assert '"tokens_per_minute": null' in lines[-1] and '"max_concurrency": 2' in lines[-1]
    status, lines = _run(capsys, "admin", "key", "create", "acme", "--name", "ci")
    assert status == 0 and lines[-1].startswith("kvg_")
    status, lines = _run(capsys, "admin", "key", "list", "acme")
    assert len(lines) == 2 and all("kvg_" not in line for line in lines)
    assert _run(capsys, "admin", "tenant", "disable", "acme")[1] == ["tenant acme is disabled"]
    status, _ = _run(capsys, "admin", "tenant", "disable", "nobody")
    assert status == 1
    assert "no tenant 'nobody'" in _run.last_err  # type: ignore[attr-defined]


def test_erase_responses_of_one_tenant(postgres_url, monkeypatch, capsys) -> None:
    monkeypatch.setenv("KVGUARD_DATABASE_URL", postgres_url)
    for name in ("acme", "other"):
        assert _run(capsys, "admin", "tenant", "create", name)[0] == 0
    engine = make_engine(postgres_url)
    factory = make_session_factory(engine)
    try:
        with session_scope(factory) as session:
            ids = {name: get_tenant(session, ref=name).id for name in ("acme", "other")}
            for name in ("acme", "acme", "other"):
                response = {"id": new_id("resp"), "status": "completed", "output": []}
                store.save(
                    session,
                    tenant_id=ids[name],
                    response=response,
                    history=[],
                    input_items=[],
                    now=utcnow(),
                )
        status, lines = _run(capsys, "admin", "tenant", "erase-responses", "acme")
        assert (status, lines) == (0, ["erased 2 stored responses of tenant acme"])
        with session_scope(factory) as session:
            assert list(session.scalars(select(StoredResponse.tenant_id))) == [ids["other"]]
            assert get_tenant(session, ref="acme").status == "active"  # the tenant stays
    finally:
        engine.dispose()
    status, _ = _run(capsys, "admin", "tenant", "erase-responses", "nobody")
    assert status == 1
    assert "no tenant 'nobody'" in _run.last_err  # type: ignore[attr-defined]


def test_real_command_line(sqlite_url, tmp_path) -> None:
    env = {**os.environ, "KVGUARD_DATABASE_URL": sqlite_url}
    done = subprocess.run(
        [sys.executable, "-m", "kvguard", "admin", "tenant", "create", "cli-tenant"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1].startswith("kvg_")
    again = subprocess.run(
        [sys.executable, "-m", "kvguard", "admin", "tenant", "create", "cli-tenant"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert again.returncode == 1
    assert "already exists" in again.stderr
