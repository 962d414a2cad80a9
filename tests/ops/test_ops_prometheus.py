"""Every dashboard query and alert rule, evaluated by a real Prometheus scraping a real stack.

The stack is the one ``kvguard demo`` runs (``kvguard.drillstack``), with the bundled model:
``drill``, a prefill/decode pair deployed as in the incident (window > prefill's pool, the legacy
rejected-but-done handoff, decode's checks skipped, no zero-on-free; the gateway sees an opaque
engine and lets mismatched handoff proofs through), ``guarded``, a unified engine with the same
drift that the gateway introspects, ``proof``, a production-mode prefill/decode pair whose prefill
was left running the legacy handoff while decode keeps its checks, and the gateway with the canary
firewall.

Traffic: tenants chatting (one streams), one hitting its rate limit, an over-long request sent
straight to an engine, the LEAK DRILL (tenant A's marked chat then tenant B's over-long one on
``drill``: the firewall cuts B's stream, stores a cross-tenant finding and quarantines the engine;
the same two requests on ``guarded``: B refused with ``context_length_exceeded``), the handoff
proof on ``proof`` (an over-long prompt refused by decode's reserved-vs-transferred check, a stream
aborted mid-transfer whose pages drain), and an echo probe that fails (its model's only engine is
quarantined). Then every panel query and alert expression must parse, the panels this scenario
lights must return data (the handoff-proof ones a count above 0), each dashboard variable's
``label_values`` must list the stack's tenants and engines, the cross-tenant alert must fire and
the drift, fault-drill (``proof`` only: the drill pair runs in development mode), handoff-proof,
probe, quarantine and coverage alerts must be active, and the leak alert must reach a webhook
through a real Alertmanager running the committed deploy/alertmanager.yml.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from ops_stack import (
    Webhook,
    base_env,
    completed_alertmanager_config,
    prom_query,
    webhook_receiver,
)
from prometheus_client.parser import text_string_to_metric_families

from canary import metrics as cm
from dashboards.alerts import ALERTS
from dashboards.build import (
    RULES_FILE,
    ScrapeTarget,
    alerting,
    engine_targets,
    scrape_config,
)
from dashboards.catalog import DASHBOARDS, VARIABLE_QUERIES
from kvguard import drillstack
from kvguard.demo import echo_probe
from kvguard.localservices import alertmanager_server, prometheus_server

BUNDLED_MODEL = (
    Path(drillstack.__file__).resolve().parents[1] / "backend" / "bundled" / "kvguard-tiny"
)
VARIABLES = {"$__rate_interval": "1m", "$__range": "5m", "$tenant": ".*", "$engine": ".*"}

# Panels the scenario must light, by dashboard uid. No outside request can make the engine's own
# page-table check fail (that is a bug, not a drill): its panel shows every reason at 0.
EXPECTED = {
    "kvguard-isolation": {
        "Critical findings (cross-tenant, cross-request)",
        "Findings by kind and severity",
        "Streams cut by the leak firewall",
        "Canary coverage (share of requests carrying a marker)",
        "Probe pass rate by engine and kind",
        "Failing probes (latest result)",
        "Last failing probe",
        "Quarantined engines",
        "Engines quarantined by the canary",
        "Page ownership / generation check failures (engine)",
    },
    "kvguard-capacity": {
        "Window vs pool vs enforced limit (gateway's view)",
        "Engine-reported capacity (tokens)",
        "Capacity drift (window > real pool)",
        "Fault drills enabled",
        "Engines not routed to, by reason",
        "Rejections by reason (gateway)",
        "Rejections by reason (engine)",
        "Rate-limited requests by limit",
        "KV pages: free / owned / quarantined",
        "Capacity report age",
    },
    "kvguard-handoff": {
        "Handoff outcomes",
        "Decode refusals by failed check",
        "Reserved vs transferred mismatches",
        "Checksum failures and late writes",
        "Quarantine drain time (p50/p95/p99)",
        "Pages freed after a drain, by release",
        "KV transfer latency (prefill)",
        "Handoff latency (decode: sent -> result)",
    },
    "kvguard-traffic": {
        "Requests by outcome",
        "Tokens by kind",
        "Errors by code",
        "Requests in flight",
        "Time to first token by tenant (streamed)",
        "Inter-token latency by tenant",
        "Time to whole answer by tenant (not streamed)",
        "Time to first token, gateway (by engine)",
        "Time to first token, engine",
        "Request duration by endpoint",
        "Gateway overhead before the engine",
    },
}
# Panels where the scenario's event must show as a count above 0 (a counter at 0 returns data too).
COUNTED = {
    "Decode refusals by failed check",
    "Reserved vs transferred mismatches",
    "Pages freed after a drain, by release",
}
LEAK_ALERT = "KvguardCrossTenantFinding"
DRILL_ALERT = "KvguardFaultDrillEnabled"
# Pending or firing: drift and the failing probe wait out their `for:`; bob has no markers.
ACTIVE = {
    LEAK_ALERT,
    "KvguardLeakFirewallCut",
    "KvguardEngineQuarantined",
    "KvguardCapacityDrift",
    DRILL_ALERT,
    "KvguardHandoffProofFailure",
    "KvguardProbeFailing",
    "KvguardCanaryCoverageLow",
}


def substitute(expr: str) -> str:
    for name, value in VARIABLES.items():
        expr = expr.replace(name, value)
    return expr


def _address(url: str) -> str:
    return url.removeprefix("http://")


def _prometheus_config(stack: drillstack.DrillStack, alertmanager: str) -> dict[str, Any]:
    """Engines labelled with the names the gateway routes by, so the two sides join; alerts to
    ``alertmanager`` (host:port)."""
    targets = [ScrapeTarget("kvguard-gateway", _address(stack.gateway))]
    targets += engine_targets(drillstack.GUARDED, [("unified", _address(stack.guarded))])
    drill = [("decode", _address(stack.drill_decode)), ("prefill", _address(stack.drill_prefill))]
    targets += engine_targets(drillstack.DRILL, drill)
    assert stack.proof_prefill is not None and stack.proof_decode is not None
    proof = [("decode", _address(stack.proof_decode)), ("prefill", _address(stack.proof_prefill))]
    targets += engine_targets(drillstack.PROOF, proof)
    return {
        **scrape_config(targets, ["alerts.yml"], interval="1s"),
        "alerting": alerting([alertmanager]),
    }


def _alertmanager_config(webhook: str) -> dict[str, Any]:
    """The committed deploy/alertmanager.yml as a user completes it (a webhook on the ``kvguard``
    receiver), waiting 1 s instead of 10 s before a group's first notification."""
    config = completed_alertmanager_config(webhook)
    config["route"]["group_wait"] = "1s"
    return config


def _leak_alert_reaches_the_receiver(webhook: Webhook) -> None:
    """Alertmanager calls the webhook with the firing leak alert, through the ``kvguard`` route."""

    def leak(body: dict[str, Any]) -> bool:
        return any(a["labels"]["alertname"] == LEAK_ALERT for a in body["alerts"])

    body = webhook.wait_for(leak, timeout_s=30)
    assert body["receiver"] == "kvguard" and body["status"] == "firing", body
    (alert,) = [a for a in body["alerts"] if a["labels"]["alertname"] == LEAK_ALERT]
    assert alert["labels"]["kind"] == "cross_tenant" and alert["labels"]["severity"] == "critical"
    assert alert["annotations"]["first_response"].startswith("Treat as a data-exposure incident")


def _fast_rules() -> str:
    """The committed rules, evaluated every second instead of every 15 s."""
    rules = yaml.safe_load(RULES_FILE.read_text())
    for group in rules["groups"]:
        group["interval"] = "1s"
    return yaml.safe_dump(rules)


def _tenant(
    client: httpx.Client, stack: drillstack.DrillStack, name: str, **fields: Any
) -> tuple[str, str]:
    r = client.post("/admin/tenants", json={"name": name, **fields}, headers=stack.admin())
    assert r.status_code == 201, r.text
    return r.json()["tenant"]["id"], r.json()["key"]["key"]


def _chat(client: httpx.Client, key: str, content: str, **extra: Any) -> httpx.Response:
    body = {"model": drillstack.GUARDED_MODEL, "max_tokens": 4, "temperature": 0, **extra}
    body["messages"] = [{"role": "user", "content": content}]
    return client.post(
        "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
    )


def _everyday_traffic(
    client: httpx.Client, stack: drillstack.DrillStack, prom: str
) -> tuple[str, str]:
    """Chats on ``guarded`` (one streamed), a rate limit, an over-long prompt at the engine.
    Returns alice's tenant id and key: every request of hers carries a marker."""
    alice_id, alice = _tenant(client, stack, "alice", canary_sample_rate=1.0)
    _, bob = _tenant(client, stack, "bob", requests_per_minute=1)
    for content in ("Repeat exactly: hello", "Repeat exactly: kv"):
        ok = _chat(client, alice, content)
        assert ok.status_code == 200, ok.text
    streamed = _chat(client, alice, "Repeat exactly: stream", stream=True)
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text, streamed.text
    assert _chat(client, bob, "hi").status_code == 200
    # bob's second request after a scrape: his unmarked traffic has a rate (coverage 0 %, not NaN).
    _wait_for(prom, 'kvguard_canary_requests_total{marked="false"}')
    limited = _chat(client, bob, "hi again")
    assert limited.status_code == 429, limited.text
    direct = httpx.post(
        stack.guarded + "/v1/completions",
        json={"model": drillstack.GUARDED_MODEL, "prompt": "x" * 3000, "max_tokens": 4},
        headers=stack.engine_auth(),
        timeout=30,
    )
    assert direct.status_code == 400, direct.text
    return alice_id, alice


def _leak_drill(client: httpx.Client, stack: drillstack.DrillStack, alice: str) -> None:
    """The incident on ``drill`` (caught by the firewall), then the same on ``guarded``."""
    _, carol = _tenant(client, stack, "carol")
    incident = drillstack.play(client, drillstack.DRILL, drillstack.DRILL_MODEL, alice, carol)
    # The engine read A_TOKENS; A's usage leaves out the marker the gateway added (estimated on
    # this declared engine with the gateway's upper bound): never more than A sent.
    assert incident.a.status == 200 and (incident.a.prompt_tokens or 0) < drillstack.A_TOKENS
    # on failure, the exchange says whether a whole marker reached B and how much text did
    assert (incident.b.status, incident.b.codes) == (200, (drillstack.CUT_CODE,)), incident.b
    assert not incident.b.marker_seen
    finding = drillstack.finding_for(client, stack.admin(), incident.b.request_id)
    assert finding is not None and finding["kind"] == "cross_tenant", finding
    assert finding["severity"] == "critical" and finding["engine"] == drillstack.DRILL
    assert drillstack.quarantine_of(client, stack.admin(), drillstack.DRILL) is not None
    guarded = drillstack.play(client, drillstack.GUARDED, drillstack.GUARDED_MODEL, alice, carol)
    assert guarded.a.status == 200
    assert (guarded.b.status, guarded.b.codes) == (400, (drillstack.REFUSED_CODE,))


def _failing_probe(stack: drillstack.DrillStack) -> float:
    """The echo probe on the drill's model, reported to the gateway: its only engine is
    quarantined, so it fails (``kvguard canary probe`` runs the same runner). Returns when."""
    started = time.time()
    probe = echo_probe(stack, drillstack.DRILL_MODEL)
    assert not probe.passed and "no_healthy_engine" in probe.observed, probe
    return started


def _last_failure(prometheus: str) -> tuple[str, str, float]:
    """(engine, kind, seconds since the epoch) the "Last failing probe" panel shows."""
    panel = next(p for p in DASHBOARDS[0].panels if p.title == "Last failing probe")
    rows = prom_query(prometheus, substitute(panel.queries[0].expr))["data"]["result"]
    assert len(rows) == 1, rows
    labels, value = rows[0]["metric"], float(rows[0]["value"][1]) / 1000
    return labels.get("engine", ""), labels.get("kind", ""), value


def _engine_value(url: str, name: str, **labels: str) -> float:
    """One series (summed over the labels not named) of an engine's /metrics."""
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


def _until(check: Any, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


def _handoff_proof(stack: drillstack.DrillStack) -> None:
    """On ``proof``: an over-long prompt (prefill's legacy handoff sends 1 page and "done") is
    refused by decode's reserved-vs-transferred check; a stream dropped while prefill is writing
    its KV over the slow link leaves its pages in quarantine until prefill confirms."""
    decode, prefill = stack.proof_decode, stack.proof_prefill
    assert decode is not None and prefill is not None
    body = {"model": drillstack.DRILL_MODEL, "max_tokens": 4, "temperature": 0}
    auth = stack.engine_auth()
    over = httpx.post(
        decode + "/v1/completions", json={**body, "prompt": "x" * 399}, headers=auth, timeout=60
    )
    assert over.status_code == 502 and over.json()["error"]["code"] == "kv_handoff_refused"
    assert over.json()["kvguard"]["handoff"]["failed_check"] == "transfer_range", over.text
    stream = {**body, "prompt": "y" * 199, "stream": True}
    with httpx.stream(
        "POST", decode + "/v1/completions", json=stream, headers=auth, timeout=60
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # keep a reference: dropping it closes the connection
        next(lines)  # admitted: its pages are reserved
        active = "kvguard_engine_handoffs_active"
        _until(lambda: _engine_value(prefill, active, state="transferring") >= 1, "transfer")
        del lines
    drained = "kvguard_engine_drained_pages_total"
    _until(lambda: _engine_value(decode, drained) > 0, "pages drained after the abort")
    assert _engine_value(decode, "kvguard_engine_handoff_late_write_pages_total") == 0


def _variables_list_the_stack(prometheus: str, tenant: str) -> None:
    """Each ``label_values(metric, label)`` Grafana runs, through Prometheus's label API."""
    want = {"tenant": {tenant}, "engine": {drillstack.DRILL, drillstack.GUARDED}}
    for name, query in VARIABLE_QUERIES.items():
        metric, label = query.removeprefix("label_values(").removesuffix(")").split(", ")
        answer = httpx.get(
            f"{prometheus}/api/v1/label/{label}/values", params={"match[]": metric}, timeout=10
        ).json()
        assert answer["status"] == "success", answer
        assert want[name] <= set(answer["data"]), (name, answer["data"])


def _wait_for(prometheus: str, expr: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if prom_query(prometheus, expr)["data"]["result"]:
            return
        time.sleep(0.5)
    raise AssertionError(f"no data for {expr} within {timeout_s} s")


def _alerts(prometheus: str) -> list[dict[str, Any]]:
    return list(httpx.get(prometheus + "/api/v1/alerts", timeout=10).json()["data"]["alerts"])


def _active_alerts(prometheus: str) -> set[str]:
    rules = httpx.get(prometheus + "/api/v1/rules", timeout=10).json()["data"]["groups"]
    return {r["name"] for g in rules for r in g["rules"] if r["state"] in ("pending", "firing")}


def _evaluate_everything(prometheus: str) -> tuple[dict[str, set[str]], set[str], list[str]]:
    """(lit panel titles by dashboard uid, titles with a value above 0, errors) of every panel
    query and alert expression."""
    lit: dict[str, set[str]] = {}
    counted: set[str] = set()
    errors = []
    for dashboard in DASHBOARDS:
        for panel in dashboard.panels:
            for query in panel.queries:
                answer = prom_query(prometheus, substitute(query.expr))
                if answer["status"] != "success":
                    errors.append(f"{panel.title}: {answer.get('error')}")
                elif answer["data"]["result"]:
                    lit.setdefault(dashboard.uid, set()).add(panel.title)
                    if any(float(r["value"][1]) > 0 for r in answer["data"]["result"]):
                        counted.add(panel.title)
    for rule in ALERTS:
        answer = prom_query(prometheus, rule.expr)
        if answer["status"] != "success":
            errors.append(f"{rule.name}: {answer.get('error')}")
    return lit, counted, errors


def _panels_lit(
    prometheus: str, timeout_s: float = 20.0
) -> tuple[dict[str, set[str]], set[str], list[str]]:
    """``_evaluate_everything`` once every expected panel is lit and counted, or at the deadline
    (the caller's asserts then say which are not)."""
    deadline = time.monotonic() + timeout_s
    while True:
        lit, counted, errors = _evaluate_everything(prometheus)
        done = all(titles <= lit.get(uid, set()) for uid, titles in EXPECTED.items())
        if errors or (done and counted >= COUNTED) or time.monotonic() > deadline:
            return lit, counted, errors
        time.sleep(0.5)


def _named(alert: dict[str, Any], name: str) -> bool:
    return bool(alert["labels"]["alertname"] == name)


def _leak_alert_fires(prometheus: str, timeout_s: float = 15.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for alert in _alerts(prometheus):
            if alert["labels"]["alertname"] == LEAK_ALERT and alert["state"] == "firing":
                return alert
        time.sleep(0.5)
    raise AssertionError(f"{LEAK_ALERT} did not fire: {_alerts(prometheus)}")


@pytest.mark.skipif(not BUNDLED_MODEL.is_dir(), reason="the leak drill needs the bundled model")
def test_every_panel_and_alert_against_a_real_prometheus(tmp_path: Path) -> None:
    env = base_env(KVGUARD_MODE="development")
    (tmp_path / "data").mkdir()
    stack = drillstack.drill_stack(tmp_path / "data", env, proof=True)
    rules = {"alerts.yml": _fast_rules()}
    with (
        webhook_receiver() as webhook,
        alertmanager_server(_alertmanager_config(webhook.url)) as alertmanager,
        drillstack.running(stack, tmp_path),
        prometheus_server(
            _prometheus_config(stack, f"{alertmanager.host}:{alertmanager.port}"), rules
        ) as prom,
        httpx.Client(base_url=stack.gateway, timeout=120) as client,
    ):
        _wait_for(prom.url, 'kvguard_gateway_engine_routable{engine=~".+"}')
        alice_id, alice = _everyday_traffic(client, stack, prom.url)
        _leak_drill(client, stack, alice)
        _handoff_proof(stack)
        probed_at = _failing_probe(stack)
        _wait_for(prom.url, 'kvguard_canary_probe_passing{kind="echo"} == 0')
        # rate() and increase() light up once two scrapes after the traffic have landed
        lit, counted, errors = _panels_lit(prom.url)
        assert errors == []
        for uid, titles in EXPECTED.items():
            assert titles <= lit.get(uid, set()), (uid, titles - lit.get(uid, set()))
        assert COUNTED - counted == set()
        _variables_list_the_stack(prom.url, alice_id)
        engine, kind, failed_at = _last_failure(prom.url)
        failing = prom_query(prom.url, f"{cm.PROBE_PASSING} == 0")["data"]["result"]
        assert [(r["metric"]["engine"], r["metric"]["kind"]) for r in failing] == [(engine, kind)]
        assert kind == "echo" and probed_at - 1 <= failed_at <= time.time()
        critical = prom_query(prom.url, substitute(DASHBOARDS[0].panels[0].queries[0].expr))
        assert float(critical["data"]["result"][0]["value"][1]) >= 1, critical
        alert = _leak_alert_fires(prom.url)
        assert alert["labels"]["severity"] == "critical"
        assert alert["labels"]["kind"] == "cross_tenant", alert
        deadline = time.monotonic() + 10
        while not _active_alerts(prom.url) >= ACTIVE and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ACTIVE - _active_alerts(prom.url) == set()
        drills = {a["labels"]["engine"] for a in _alerts(prom.url) if _named(a, DRILL_ALERT)}
        assert drills == {drillstack.PROOF}, drills
        up = prom_query(prom.url, "up == 0")["data"]["result"]
        assert up == [], up
        _leak_alert_reaches_the_receiver(webhook)
