"""The findings loop on the CLI (``kvguard canary findings|finding|probe-runs|clear-quarantine``)
against a real gateway on 127.0.0.1: a compromised provider (the stand-in in canary_harness) leaks
one tenant's marker to another, the firewall stores a finding and quarantines the engine; the
operator lists it, reads it, sees the failing probe, and clears the quarantine."""

from __future__ import annotations

import asyncio
import json

import pytest
from canary_harness import PROVIDER_MODEL, TEST_CANARY_KEY, bearer, canary_gateway, provider_engine

from kvguard.cli import main


def _chat(stream: bool) -> dict:
    return {
        "model": PROVIDER_MODEL,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 32,
        "stream": stream,
    }


async def _kvguard(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``kvguard ARGV`` in a thread (the gateway serves from this test's event loop)."""
    status = await asyncio.to_thread(main, list(argv))
    out, err = capsys.readouterr()
    return status, out, err


async def test_an_operator_lists_reads_and_clears_from_the_cli(
    gateway_settings, canary_settings, provider, capsys, monkeypatch
) -> None:
    settings = gateway_settings(engines=[provider_engine(provider.url)])
    async with canary_gateway(settings, canary_settings()) as gw:
        monkeypatch.setenv("KVGUARD_CANARY_GATEWAY_URL", gw.url)
        monkeypatch.setenv("KVGUARD_ADMIN_TOKEN", gw.state.settings.admin_secret())
        monkeypatch.setenv("KVGUARD_CANARY_KEY", TEST_CANARY_KEY)
        victim_id, victim_key = await gw.create_tenant("victim", canary_sample_rate=1.0)
        _, observer_key = await gw.create_tenant("observer")
        r = await gw.client.post(
            "/v1/chat/completions", headers=bearer(victim_key), json=_chat(False)
        )
        assert r.status_code == 200, r.text
        provider.controls.mode = "leak"
        r = await gw.client.post(
            "/v1/chat/completions", headers=bearer(observer_key), json=_chat(True)
        )
        assert "isolation_violation" in r.text
        observer_request = r.headers["x-kvguard-request-id"]

        status, out, _ = await _kvguard(capsys, "canary", "findings")
        assert status == 0
        header, row = out.strip().splitlines()
        assert header.split() == ["id", "detected_at", "kind", "severity", "engine", "action"] + [
            "victim_tenant_id"
        ]
        cells = row.split()
        finding_id = cells[0]
        assert cells[2:] == ["cross_tenant", "critical", "thirdparty", "cut_quarantined", victim_id]

        status, out, _ = await _kvguard(capsys, "canary", "findings", "--kind", "cross_request")
        assert (status, out.strip()) == (0, "(none)")
        status, out, _ = await _kvguard(capsys, "canary", "findings", "--json", "--limit", "5")
        assert status == 0 and [f["id"] for f in json.loads(out)] == [int(finding_id)]

        status, out, _ = await _kvguard(capsys, "canary", "finding", finding_id)
        assert status == 0
        shown = dict(line.split(None, 1) for line in out.strip().splitlines())
        assert shown["observer_request_id"] == observer_request
        assert (shown["evidence"], shown["engine"]) == ("confirmed", "thirdparty")
        status, _, err = await _kvguard(capsys, "canary", "finding", "999999")
        assert status == 1 and "404: no finding 999999" in err

        # The echo probe on the quarantined engine's model fails and is stored.
        status, _, _ = await _kvguard(
            capsys, "canary", "probe", "--once", "--kind", "echo", "--model", PROVIDER_MODEL
        )
        assert status == 1
        status, out, _ = await _kvguard(capsys, "canary", "probe-runs", "--kind", "echo")
        assert status == 0
        (run,) = out.strip().splitlines()[1:]
        assert run.split()[2:5] == ["echo", "-", "False"] and "no_healthy_engine" in run

        status, out, _ = await _kvguard(capsys, "canary", "clear-quarantine", "thirdparty")
        assert status == 0 and "thirdparty: quarantine cleared" in out
        engines = (await gw.client.get("/admin/engines", headers=gw.admin)).json()
        assert engines[0]["quarantine_reason"] is None
        provider.controls.mode = "plain"
        r = await gw.client.post(
            "/v1/chat/completions", headers=bearer(observer_key), json=_chat(False)
        )
        assert r.status_code == 200, r.text
        status, _, err = await _kvguard(capsys, "canary", "clear-quarantine", "nosuch")
        assert status == 1 and "404" in err

        monkeypatch.setenv("KVGUARD_ADMIN_TOKEN", "not-the-admin-token")
        status, _, err = await _kvguard(capsys, "canary", "findings")
        assert status == 2 and err.startswith("kvguard canary: 401")


def test_without_a_gateway_the_commands_say_so(capsys, monkeypatch) -> None:
    monkeypatch.delenv("KVGUARD_CANARY_GATEWAY_URL", raising=False)
    assert main(["canary", "findings"]) == 2
    assert "--gateway" in capsys.readouterr().err
    assert main(["canary", "probe-runs", "--gateway", "http://127.0.0.1:9"]) == 2
    assert "cannot reach the gateway at http://127.0.0.1:9" in capsys.readouterr().err
