"""One tenant's bytes must not stop the audit of everyone on a replica.

Attacker: a tenant that puts bytes PostgreSQL refuses into a field that reaches a database row:
``"model": "kvguard-tiny\\u0000"`` (a NUL) or a lone surrogate. It used to get an ordinary 404
while its audit row, NUL and all, failed the writer's batch every 0.5 s for ever: no audit row,
usage count or key last-used stamp of any tenant was written on that replica again, and the
pending rows were lost at shutdown.

Proves, against the gateway as ``kvguard gateway`` serves it on a real PostgreSQL with the real
engine: such a field is a 400 naming it (refused at the edge), and every request of the attacker
and of a bystander afterwards has its audit row in the database within a flush or two, including
the rows still pending when the gateway stops.
"""

from __future__ import annotations

import json
import time

import httpx
from hostile_harness import ENGINE_MODEL, gateway_settings, openai_error, served_gateway
from sqlalchemy import select

from contracts.sql import make_session_factory, session_scope
from gateway.db.models import RequestAudit
from gateway.db.session import make_engine
from kvguard.testing import EngineProcess


def _audited(postgres_url: str) -> list[tuple[str, str, int]]:
    engine = make_engine(postgres_url)
    try:
        with session_scope(make_session_factory(engine)) as session:
            rows = session.execute(
                select(RequestAudit.tenant_id, RequestAudit.outcome, RequestAudit.http_status)
            ).all()
        return sorted((str(t), str(o), int(s)) for t, o, s in rows)
    finally:
        engine.dispose()


def _chat(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_bytes_postgresql_refuses_are_refused_and_audit_keeps_writing(
    postgres_url: str, engine: EngineProcess
) -> None:
    settings = gateway_settings(postgres_url, engine.url, audit_flush_interval_s=0.05)
    with served_gateway(settings, canary=False) as gw:
        attacker, attacker_key = gw.create_tenant("attacker")
        bystander, bystander_key = gw.create_tenant("bystander")
        attack = {"Authorization": f"Bearer {attacker_key}"}
        calm = {"Authorization": f"Bearer {bystander_key}"}
        for bad in (ENGINE_MODEL + "\u0000", ENGINE_MODEL + "\ud800"):
            raw = json.dumps(_chat(bad)).encode()  # ASCII: \u0000 and \ud800 as JSON escapes
            headers = {**attack, "Content-Type": "application/json"}
            r = httpx.post(
                gw.url + "/v1/chat/completions", content=raw, headers=headers, timeout=30
            )
            assert r.status_code == 400, r.text
            assert openai_error(r)["param"] == "model", r.text
        for headers in (attack, calm):
            body = _chat(ENGINE_MODEL)
            r = httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
        expected = [(attacker, "completed", 200), (bystander, "completed", 200)]
        deadline = time.monotonic() + 10
        while _audited(postgres_url) != sorted(expected) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _audited(postgres_url) == sorted(expected)
        # The last rows are still pending when the gateway stops: the final flush writes them.
        r = httpx.post(
            gw.url + "/v1/chat/completions", json=_chat("no-such-model"), headers=calm, timeout=30
        )
        assert r.status_code == 404, r.text
    assert (bystander, "rejected", 404) in _audited(postgres_url)
