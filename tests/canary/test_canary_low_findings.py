"""Lower-severity findings on the real gateway path: an engine reporting more prompt tokens than
the gateway sent, and a first token too fast for the prompt on that engine."""

from __future__ import annotations

from canary_harness import PROVIDER_MODEL, bearer, canary_gateway, provider_engine


def _body(stream: bool) -> dict:
    words = " ".join(["word"] * 40)
    return {"model": PROVIDER_MODEL, "prompt": words, "max_tokens": 4, "stream": stream}


async def test_usage_above_the_gateways_count_is_a_low_finding(
    gateway_settings, canary_settings, provider
) -> None:
    settings = gateway_settings(engines=[provider_engine(provider.url)])
    async with canary_gateway(settings, canary_settings()) as gw:
        tenant_id, key = await gw.create_tenant("acme")
        ok = await gw.client.post("/v1/completions", headers=bearer(key), json=_body(False))
        assert ok.status_code == 200
        provider.controls.usage_prompt_tokens = 5000  # far more than the 199-byte prompt
        for stream in (False, True):
            r = await gw.client.post("/v1/completions", headers=bearer(key), json=_body(stream))
            assert r.status_code == 200
        findings = await gw.findings()
        assert [(f["kind"], f["severity"], f["evidence"], f["action"]) for f in findings] == [
            ("usage_mismatch", "low", "measured", "recorded")
        ]  # one row per engine and kind per interval
        f = findings[0]
        assert (f["observer_tenant_id"], f["engine"], f["victim_tenant_id"]) == (
            tenant_id,
            "thirdparty",
            None,
        )
        assert (
            f["detail"] == "gateway counted 215 prompt tokens (upper bound), engine reported 5000"
        )
        metrics = await gw.metrics()
        assert 'kvguard_canary_findings_total{kind="usage_mismatch",severity="low"} 2.0' in metrics


async def test_an_implausibly_fast_first_token_is_a_low_finding(
    gateway_settings, canary_settings, provider
) -> None:
    settings = gateway_settings(engines=[provider_engine(provider.url)])
    canary = canary_settings(
        canary_ttft_min_prompt_tokens=100, canary_ttft_min_samples=5, canary_ttft_history=10
    )
    async with canary_gateway(settings, canary) as gw:
        _, key = await gw.create_tenant("acme")
        provider.controls.first_token_delay_s = 0.25  # this engine's honest prefill time
        for _ in range(5):
            r = await gw.client.post("/v1/completions", headers=bearer(key), json=_body(True))
            assert r.status_code == 200
        assert await gw.findings() == []
        provider.controls.first_token_delay_s = 0.0  # an answer that skipped the prefill
        r = await gw.client.post("/v1/completions", headers=bearer(key), json=_body(True))
        assert r.status_code == 200  # low severity: recorded, never cut
        findings = await gw.findings()
        assert [(f["kind"], f["severity"]) for f in findings] == [("fast_first_token", "low")]
        assert "for 215 prompt tokens" in findings[0]["detail"]
