"""Suspected findings (a damaged copy of another tenant's marker) on the real gateway (uvicorn on
127.0.0.1, SQLite, in-process marker records) against the compromised provider of
``canary_harness``: attribution through the issue records, quarantine by setting or when
corroborated (issue 32, finding 6: an engine copying other tenants' context stayed in service
while its leaks were only ever suspected), and the refusal of requests that carry a foreign
tag."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from canary_harness import (
    PROVIDER_MODEL,
    bearer,
    canary_gateway,
    provider_engine,
    sse_text,
)

from canary.kinds import Evidence, FindingKind
from canary.markers import PREFIX, TAG_CHARS, MarkerCodec, MarkerKeyring
from canary.records import MarkerRecord
from canary.runtime import victim_record
from canary.scanner import Finding


def _chat(stream: bool, content: str = "hello") -> dict:
    return {
        "model": PROVIDER_MODEL,
        "messages": [{"role": "user", "content": content}],
        "stream": stream,
    }


async def _leak(gw, provider, observer_key: str, chars: int):
    provider.controls.mode, provider.controls.leak_chars = "leak", chars
    provider.controls.splits = [20, 30, 41]
    r = await gw.client.post("/v1/chat/completions", headers=bearer(observer_key), json=_chat(True))
    provider.controls.mode = "plain"
    return r


@pytest.mark.parametrize("on_suspected", [True, False])
async def test_a_damaged_copy_is_attributed_and_quarantines_by_setting(
    gateway_settings, canary_settings, provider, on_suspected: bool
) -> None:
    settings = gateway_settings(engines=[provider_engine(provider.url)])
    canary = canary_settings(canary_quarantine_on_suspected=on_suspected)
    async with canary_gateway(settings, canary) as gw:
        victim_id, victim_key = await gw.create_tenant("victim", canary_sample_rate=1.0)
        observer_id, observer_key = await gw.create_tenant("observer")
        provider.controls.mode = "plain"
        r = await gw.client.post(
            "/v1/chat/completions", headers=bearer(victim_key), json=_chat(False)
        )
        victim_request = r.headers["x-kvguard-request-id"]
        marker = provider.controls.stolen_marker()
        await gw.runtime.injector.drain()
        # 23 body characters show tag, key id and nonce: the victim's request is found; 12 do not.
        for body_chars, request in ((23, victim_request), (12, None)):
            r = await _leak(gw, provider, observer_key, len(PREFIX) + body_chars)
            _, errors = sse_text(r.content)
            assert [e["code"] for e in errors] == ["isolation_violation"]
            assert marker[: len(PREFIX) + TAG_CHARS] not in r.text
            finding = (await gw.findings())[0]
            assert (finding["severity"], finding["evidence"], finding["kind"]) == (
                "high",
                "suspected",
                "cross_tenant",
            )
            assert (finding["victim_tenant_id"], finding["observer_tenant_id"]) == (
                victim_id,
                observer_id,
            )
            assert finding["victim_request_id"] == request
            action = "cut_quarantined" if on_suspected else "cut"
            assert finding["action"] == action
            engines = (await gw.client.get("/admin/engines", headers=gw.admin)).json()
            assert (engines[0]["quarantine_reason"] is not None) is on_suspected
            if on_suspected:
                cleared = await gw.client.delete(
                    "/admin/engines/thirdparty/quarantine", headers=gw.admin
                )
                assert cleared.status_code in (200, 204), cleared.text


async def test_suspected_copies_for_two_requesting_tenants_quarantine_the_engine(
    gateway_settings, canary_settings, provider
) -> None:
    """Damaged copies showing the victim's nonce, of a request this engine served, for two
    different requesting tenants within the window: corroborated, the engine is quarantined
    (``canary.corroboration``). Copies for one tenant, or showing no nonce, are not enough."""
    settings = gateway_settings(engines=[provider_engine(provider.url)])
    async with canary_gateway(settings, canary_settings()) as gw:
        victim_id, victim_key = await gw.create_tenant("victim", canary_sample_rate=1.0)
        _, first_key = await gw.create_tenant("first")
        _, second_key = await gw.create_tenant("second")
        provider.controls.mode = "plain"
        await gw.client.post("/v1/chat/completions", headers=bearer(victim_key), json=_chat(False))
        await gw.runtime.injector.drain()  # the victim's issue record, with its engine
        leaks = [
            (first_key, len(PREFIX) + 12, "cut"),  # the tag only: counts for nobody
            (first_key, len(PREFIX) + 25, "cut"),  # shows the nonce: 1 tenant so far
            (first_key, len(PREFIX) + 25, "cut"),  # the same tenant again: still 1
            (second_key, len(PREFIX) + 25, "cut_quarantined"),  # a second tenant: corroborated
        ]
        for key, chars, action in leaks:
            r = await _leak(gw, provider, key, chars)
            assert [e["code"] for e in sse_text(r.content)[1]] == ["isolation_violation"]
            finding = (await gw.findings())[0]
            assert (finding["evidence"], finding["victim_tenant_id"]) == ("suspected", victim_id)
            assert finding["action"] == action, finding
        engines = (await gw.client.get("/admin/engines", headers=gw.admin)).json()
        assert engines[0]["quarantine_reason"].startswith("canary: isolation finding")
        refused = await gw.client.post(
            "/v1/chat/completions", headers=bearer(first_key), json=_chat(False)
        )
        assert (refused.status_code, refused.json()["error"]["code"]) == (503, "no_healthy_engine")


async def test_a_request_carrying_a_foreign_tag_is_refused_before_the_engine(
    gateway_settings, canary_settings, provider
) -> None:
    settings = gateway_settings(engines=[provider_engine(provider.url)])
    async with canary_gateway(settings, canary_settings()) as gw:
        _, victim_key = await gw.create_tenant("victim", canary_sample_rate=1.0)
        _, observer_key = await gw.create_tenant("observer")
        provider.controls.mode = "plain"
        await gw.client.post("/v1/chat/completions", headers=bearer(victim_key), json=_chat(False))
        tagged = provider.controls.stolen_marker()[: len(PREFIX) + TAG_CHARS] + "QQQ"
        seen = len(provider.controls.seen)
        for stream in (False, True):
            r = await gw.client.post(
                "/v1/chat/completions",
                headers=bearer(observer_key),
                json=_chat(stream, f"Repeat: {tagged}"),
            )
            assert r.status_code == 400
            error = r.json()["error"]
            assert (error["code"], error["type"]) == (
                "foreign_canary_marker",
                "invalid_request_error",
            )
            assert tagged not in r.text
        assert len(provider.controls.seen) == seen  # never reached the engine
        assert await gw.findings() == []
        # The tenant's own tag is not refused.
        r = await gw.client.post(
            "/v1/chat/completions", headers=bearer(victim_key), json=_chat(False, tagged)
        )
        assert r.status_code == 200


def test_a_suspected_nonce_names_a_request_only_of_the_tagged_tenant() -> None:
    codec = MarkerCodec(MarkerKeyring({1: bytes(range(32))}, current=1))
    marker = codec.issue("victim")
    found = Finding(
        kind=FindingKind.CROSS_TENANT,
        evidence=Evidence.SUSPECTED,
        position=0,
        victim_tag=marker.tenant_tag,
        victim_tenant="victim",
        key_id=1,
        victim_nonce=marker.nonce,
    )
    now = datetime.now(UTC)
    mine = MarkerRecord(marker.nonce, "req-v", "victim", "e1", now)
    theirs = MarkerRecord(marker.nonce, "req-x", "someone-else", "e1", now)
    assert victim_record(found, mine) is mine
    assert victim_record(found, theirs) is None
    assert victim_record(found, None) is None
