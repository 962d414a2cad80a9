"""A third-party provider through litellm (a stand-in on a real port, standin_openai.provider_app):
reached with credentials litellm reads from the environment or with a key reference registered
through the admin API; nothing of kvguard's (tenant id, request id, trace context) leaves unless
the operator opted in; the prompt is counted with the model's own tokenizer."""

from __future__ import annotations

from typing import Any

from gateway_harness import bearer, running_gateway
from sqlalchemy import select
from standin_openai import ProviderControls, provider_app

from contracts.sql import session_scope
from gateway.db.models import RegisteredEngine, RequestAudit
from gateway.engines.provider_count import upper_bound_tokens
from kvguard.testing import serve

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]


def _engine(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": "hosted",
        "kind": "litellm",
        "base_url": f"{url}/v1",
        "model": "gpt-4o-mini",
        "litellm_model": "openai/gpt-4o-mini",
        "declared_max_model_len": 128000,
        "allow_unverified": True,
        **extra,
    }


def _kvguard_headers(headers: dict[str, str]) -> list[str]:
    return [h for h in headers if h.startswith("x-kvguard") or h in ("traceparent", "tracestate")]


async def test_provider_with_environment_credentials_and_no_kvguard_headers(
    make_settings, monkeypatch
) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-litellm-reads-this")
    controls = ProviderControls()
    provider = await serve(provider_app(controls))
    try:
        settings = make_settings(engines=[_engine(provider.url)])
        async with running_gateway(settings) as gw:
            _, key = await gw.create_tenant("acme")
            body = {"model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": 8}
            r = await gw.client.post("/v1/chat/completions", json=body, headers=bearer(key))
            assert r.status_code == 200, r.text
            r = await gw.client.post(
                "/v1/chat/completions", json={**body, "stream": True}, headers=bearer(key)
            )
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
            for headers in controls.traffic.headers:
                assert headers["authorization"] == "Bearer sk-litellm-reads-this"
                assert _kvguard_headers(headers) == []
            await gw.state.audit.flush()
            with session_scope(gw.state.sessions) as session:
                counted = session.scalars(select(RequestAudit.prompt_tokens)).all()
            expected = upper_bound_tokens("openai/gpt-4o-mini", None, MESSAGES)
            assert counted == [expected, expected] and expected == 3 + 2 * 4 + 1 + 3 + 1 + 7
    finally:
        await provider.stop()


async def test_admin_registered_provider_holds_a_key_reference(make_settings, monkeypatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("KVG_PROVIDER_KEY", "sk-only-in-the-environment")
    controls = ProviderControls()
    provider = await serve(provider_app(controls))
    try:
        async with running_gateway(make_settings()) as gw:
            literal = await gw.client.post(
                "/admin/engines",
                json=_engine(provider.url, api_key="sk-literal"),
                headers=gw.admin,
            )
            assert literal.status_code == 400  # a key is never sent to (or stored by) the API
            r = await gw.client.post(
                "/admin/engines",
                json=_engine(provider.url, api_key_env="KVG_PROVIDER_KEY"),
                headers=gw.admin,
            )
            assert r.status_code == 201, r.text
            assert r.json()["holds_key"] is True and r.json()["sends_kvguard_headers"] is False
            listed = await gw.client.get("/admin/engines", headers=gw.admin)
            assert "sk-only-in-the-environment" not in listed.text
            with session_scope(gw.state.sessions) as session:
                row = session.get(RegisteredEngine, "hosted")
                assert row is not None and row.api_key_env == "KVG_PROVIDER_KEY"
                stored = " ".join(str(v) for v in vars(row).values())
                assert "sk-only-in-the-environment" not in stored

            _, key = await gw.create_tenant("acme")
            body = {"model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": 8}
            r = await gw.client.post("/v1/chat/completions", json=body, headers=bearer(key))
            assert r.status_code == 200, r.text
            sent = controls.traffic.headers[-1]
            assert sent["authorization"] == "Bearer sk-only-in-the-environment"
            assert _kvguard_headers(sent) == []
    finally:
        await provider.stop()


async def test_operator_opt_in_forwards_kvguard_headers(make_settings, monkeypatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    controls = ProviderControls()
    provider = await serve(provider_app(controls))
    try:
        settings = make_settings(engines=[_engine(provider.url, send_kvguard_headers=True)])
        async with running_gateway(settings) as gw:
            tenant, key = await gw.create_tenant("acme")
            body = {"model": "gpt-4o-mini", "messages": MESSAGES, "max_tokens": 8}
            r = await gw.client.post("/v1/chat/completions", json=body, headers=bearer(key))
            assert r.status_code == 200
            assert controls.traffic.headers[-1]["x-kvguard-tenant"] == tenant
    finally:
        await provider.stop()
