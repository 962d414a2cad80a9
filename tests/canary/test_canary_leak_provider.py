"""The leak firewall on the real gateway (uvicorn on 127.0.0.1, PostgreSQL, Redis) against a
compromised third-party provider (a stand-in, see canary_harness) that hands one tenant's
prompt, with the marker the gateway injected into it, to another tenant."""

from __future__ import annotations

import logging

import pytest
from canary_harness import (
    PROVIDER_MODEL,
    bearer,
    canary_gateway,
    provider_engine,
    sse_text,
)

from canary.markers import MARKER_CHARS, TAG_CHARS

TAG_PREFIX = 5 + TAG_CHARS  # "CNRY-" + the owner tag: enough to name the victim


def _chat(stream: bool, content: str = "hello there") -> dict:
    return {
        "model": PROVIDER_MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": content},
        ],
        "max_tokens": 32,
        "stream": stream,
    }


async def _victim_request(gw, provider, key: str) -> tuple[str, str]:
    """The victim's marked request; (its request id, the marker the provider received)."""
    provider.controls.mode = "plain"
    r = await gw.client.post("/v1/chat/completions", headers=bearer(key), json=_chat(False))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == (
        "hello from the provider"
    )
    marker = provider.controls.stolen_marker()
    system = provider.controls.seen[-1]["messages"][0]["content"]
    assert system == f"{marker}\nYou are a helpful assistant."
    return r.headers["x-kvguard-request-id"], marker


def _never_shows(marker: str, raw: str) -> None:
    assert marker not in raw and marker[:TAG_PREFIX] not in raw and marker[5:TAG_PREFIX] not in raw


async def test_a_leaked_marker_is_cut_recorded_and_the_engine_quarantined(
    gateway_settings, canary_settings, postgres_url, redis_url, provider, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="kvguard.canary")
    settings = gateway_settings(
        database_url=postgres_url, redis_url=redis_url, engines=[provider_engine(provider.url)]
    )
    async with canary_gateway(settings, canary_settings()) as gw:
        victim_id, victim_key = await gw.create_tenant("victim", canary_sample_rate=1.0)
        observer_id, observer_key = await gw.create_tenant("observer")
        victim_request, marker = await _victim_request(gw, provider, victim_key)

        provider.controls.mode, provider.controls.splits = "leak", [12, 25, 40]
        r = await gw.client.post(
            "/v1/chat/completions", headers=bearer(observer_key), json=_chat(True)
        )
        assert r.status_code == 200  # the stream had started; it ends with an error event
        text, errors = sse_text(r.content)
        _never_shows(marker, r.text)
        assert text == "Sure! The code is " and "[DONE]" not in r.text
        assert [e["code"] for e in errors] == ["isolation_violation"]
        observer_request = r.headers["x-kvguard-request-id"]

        findings = await gw.findings()
        assert len(findings) == 1
        f = findings[0]
        assert (f["kind"], f["severity"], f["evidence"], f["action"]) == (
            "cross_tenant",
            "critical",
            "confirmed",
            "cut_quarantined",
        )
        assert (f["victim_tenant_id"], f["observer_tenant_id"], f["engine"]) == (
            victim_id,
            observer_id,
            "thirdparty",
        )
        assert (f["observer_request_id"], f["victim_request_id"]) == (
            observer_request,
            victim_request,
        )
        assert f["victim_engine"] == "thirdparty" and f["key_id"] == 1

        engines = (await gw.client.get("/admin/engines", headers=gw.admin)).json()
        assert engines[0]["quarantine_reason"] == (
            f"canary: isolation finding on request {observer_request}"
        )
        refused = await gw.client.post(
            "/v1/chat/completions", headers=bearer(observer_key), json=_chat(False)
        )
        assert (refused.status_code, refused.json()["error"]["code"]) == (503, "no_healthy_engine")

        mine = await gw.client.get("/v1/canary/findings", headers=bearer(victim_key))
        assert [(x["kind"], x["victim_request_id"]) for x in mine.json()] == [
            ("cross_tenant", victim_request)
        ]
        assert "observer_tenant_id" not in mine.json()[0] and "engine" not in mine.json()[0]
        theirs = await gw.client.get("/v1/canary/findings", headers=bearer(observer_key))
        assert theirs.json() == []

        metrics = await gw.metrics()
        assert (
            'kvguard_canary_findings_total{kind="cross_tenant",severity="critical"} 1.0' in metrics
        )
        assert 'kvguard_canary_cuts_total{engine="thirdparty",kind="cross_tenant"} 1.0' in metrics
        assert 'kvguard_canary_quarantines_total{engine="thirdparty"} 1.0' in metrics
        assert f'kvguard_canary_markers_injected_total{{tenant="{victim_id}"}} 1.0' in metrics
        assert (
            'kvguard_gateway_requests_total{code="isolation_violation",endpoint="chat.completions",'
            f'outcome="cut",tenant="{observer_id}"}} 1.0'
        ) in metrics

    logged = [rec.getMessage() for rec in caplog.records if rec.name == "kvguard.canary"]
    finding_lines = [line for line in logged if "isolation finding" in line]
    assert len(finding_lines) == 1
    line = finding_lines[0]
    assert observer_request in line and victim_request in line and victim_id in line
    for text in logged:
        _never_shows(marker, text)


def _splits(n: int, marker_at: int) -> list[list[int]]:
    """Every 2-way split from just before to just after the marker, pairs of splits inside it,
    and one character per chunk."""
    around = range(max(0, marker_at - 2), min(n, marker_at + MARKER_CHARS + 2) + 1)
    out = [[s] for s in around]
    out += [[s, s + 7] for s in range(marker_at, marker_at + MARKER_CHARS, 5)]
    out.append(list(range(1, n)))
    return out


async def test_no_chunking_delivers_the_victims_marker(
    gateway_settings, canary_settings, postgres_url, redis_url, provider
) -> None:
    settings = gateway_settings(
        database_url=postgres_url, redis_url=redis_url, engines=[provider_engine(provider.url)]
    )
    # Quarantine is configurable: off here so one engine can be hit at every chunking.
    async with canary_gateway(settings, canary_settings(canary_quarantine_on_cut=False)) as gw:
        _, victim_key = await gw.create_tenant("victim", canary_sample_rate=1.0)
        _, observer_key = await gw.create_tenant("observer")
        _, marker = await _victim_request(gw, provider, victim_key)
        provider.controls.mode = "leak"
        answer = f"Sure! The code is {marker}, as requested."
        requests = 0
        for splits in _splits(len(answer), answer.index(marker)):
            provider.controls.splits = splits
            for endpoint, body in (
                ("/v1/chat/completions", _chat(True)),
                ("/v1/completions", {"model": PROVIDER_MODEL, "prompt": "hi", "stream": True}),
            ):
                r = await gw.client.post(endpoint, headers=bearer(observer_key), json=body)
                requests += 1
                text, errors = sse_text(r.content)
                _never_shows(marker, r.text)
                assert [e["code"] for e in errors] == ["isolation_violation"], splits
                assert answer.startswith(text)
        flat = await gw.client.post(
            "/v1/chat/completions", headers=bearer(observer_key), json=_chat(False)
        )
        requests += 1
        assert (flat.status_code, flat.json()["error"]["code"]) == (502, "isolation_violation")
        _never_shows(marker, flat.text)
        findings = await gw.findings(limit=1000)
        assert len(findings) == requests
        assert {(f["kind"], f["severity"], f["action"]) for f in findings} == {
            ("cross_tenant", "critical", "cut")
        }


@pytest.mark.parametrize("where", ["second_choice", "side_field", "error_event"])
async def test_a_marker_hidden_outside_the_answer_text_is_caught(
    gateway_settings, canary_settings, postgres_url, provider, where
) -> None:
    settings = gateway_settings(database_url=postgres_url, engines=[provider_engine(provider.url)])
    async with canary_gateway(settings, canary_settings(canary_quarantine_on_cut=False)) as gw:
        _, victim_key = await gw.create_tenant("victim", canary_sample_rate=1.0)
        _, observer_key = await gw.create_tenant("observer")
        _, marker = await _victim_request(gw, provider, victim_key)
        provider.controls.mode, provider.controls.leak_where = "leak", where
        for splits in (None, [4, 9, 20, 33]):
            provider.controls.splits = splits
            r = await gw.client.post(
                "/v1/chat/completions", headers=bearer(observer_key), json=_chat(True)
            )
            _never_shows(marker, r.text)  # a side field shows at most CNRY- and 7 characters
            assert [e["code"] for e in sse_text(r.content)[1]] == ["isolation_violation"]
        if where != "error_event":
            flat = await gw.client.post(
                "/v1/chat/completions", headers=bearer(observer_key), json=_chat(False)
            )
            assert flat.status_code == 502 and marker not in flat.text
        assert {f["kind"] for f in await gw.findings()} == {"cross_tenant"}


async def test_a_marker_in_an_engines_refusal_is_caught(
    gateway_settings, canary_settings, postgres_url, provider
) -> None:
    """An engine's own 4xx passes through with its message screened; its ``code``, ``type`` and
    ``param`` went out only without addresses, unscreened: a foreign marker there reached the
    client whole. Every string of the refusal is screened now, streamed request or not."""
    settings = gateway_settings(database_url=postgres_url, engines=[provider_engine(provider.url)])
    async with canary_gateway(settings, canary_settings(canary_quarantine_on_cut=False)) as gw:
        _, victim_key = await gw.create_tenant("victim", canary_sample_rate=1.0)
        _, observer_key = await gw.create_tenant("observer")
        _, marker = await _victim_request(gw, provider, victim_key)
        provider.controls.mode, provider.controls.leak_where = "leak", "refusal"
        for stream in (False, True):
            r = await gw.client.post(
                "/v1/chat/completions", headers=bearer(observer_key), json=_chat(stream)
            )
            _never_shows(marker, r.text)
            assert r.json()["error"]["code"] == "isolation_violation", r.text
        assert {f["kind"] for f in await gw.findings()} == {"cross_tenant"}


async def test_a_marker_beside_an_embedding_is_caught(
    gateway_settings, canary_settings, postgres_url, provider
) -> None:
    """An embeddings answer's vectors are numbers (or base64 of them) no marker is copied into,
    but every other string of it is the engine's, as a completion's side fields are: they are
    screened. They went out unscreened: a compromised provider's extra field carried the
    victim's marker to another tenant whole."""
    settings = gateway_settings(database_url=postgres_url, engines=[provider_engine(provider.url)])
    async with canary_gateway(settings, canary_settings(canary_quarantine_on_cut=False)) as gw:
        _, victim_key = await gw.create_tenant("victim", canary_sample_rate=1.0)
        _, observer_key = await gw.create_tenant("observer")
        _, marker = await _victim_request(gw, provider, victim_key)
        ask = {"model": PROVIDER_MODEL, "input": "hello"}
        for encoding in ("float", "base64"):
            provider.controls.mode = "plain"
            body = {**ask, "encoding_format": encoding}
            r = await gw.client.post("/v1/embeddings", headers=bearer(observer_key), json=body)
            assert r.status_code == 200 and r.json()["data"][0]["index"] == 0, r.text
            provider.controls.mode, provider.controls.leak_where = "leak", "side_field"
            r = await gw.client.post("/v1/embeddings", headers=bearer(observer_key), json=body)
            _never_shows(marker, r.text)
            assert r.json()["error"]["code"] == "isolation_violation", r.text
        assert {f["kind"] for f in await gw.findings()} == {"cross_tenant"}


async def test_the_tenant_never_sees_its_own_marker(
    gateway_settings, canary_settings, redis_url, provider
) -> None:
    settings = gateway_settings(redis_url=redis_url, engines=[provider_engine(provider.url)])
    async with canary_gateway(settings, canary_settings()) as gw:
        tenant_id, key = await gw.create_tenant("acme", canary_sample_rate=1.0)
        provider.controls.mode = "echo_system"
        for stream, splits in ((False, None), (True, None), (True, list(range(1, 200)))):
            provider.controls.splits = splits
            r = await gw.client.post(
                "/v1/chat/completions", headers=bearer(key), json=_chat(stream)
            )
            assert r.status_code == 200
            text = (
                sse_text(r.content)[0] if stream else r.json()["choices"][0]["message"]["content"]
            )
            assert text == "You said: \nYou are a helpful assistant. -- done."
            assert "CNRY" not in r.text
            sent = provider.controls.seen[-1]["messages"][0]["content"]
            assert sent.startswith("CNRY-")
        assert await gw.findings() == []
        await gw.runtime.injector.drain()
        nonce_records = [
            await gw.runtime._store.get(
                gw.runtime.codec.verify(m["messages"][0]["content"][:37]).nonce
            )
            for m in provider.controls.seen
        ]
        assert [(r.tenant_id, r.engine) for r in nonce_records] == [(tenant_id, "thirdparty")] * 3
