"""Render the dashboards, alert rules, Grafana provisioning and Prometheus configs.

``python -m dashboards.build`` writes the committed files; ``--check`` fails when a committed file
differs from what the code renders (CI and the tests run it), so the reviewed JSON and the
Python source never drift apart.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dashboards.alerts import ALERTS
from dashboards.catalog import DASHBOARDS, VARIABLE_QUERIES
from dashboards.grafana_json import dashboard_json
from dashboards.spec import AlertRule

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
RULES_FILE = ROOT / "prometheus" / "alerts.yml"
DATASOURCE_UID = "kvguard-prometheus"  # the provisioned Prometheus; dashboards never name it


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    """One /metrics endpoint; ``labels`` name what it is (engine + role for engines)."""

    job: str
    address: str  # host:port
    labels: tuple[tuple[str, str], ...] = ()


def rule_json(rule: AlertRule) -> dict[str, Any]:
    return {
        "alert": rule.name,
        "expr": rule.expr,
        "for": rule.for_,
        "labels": {"severity": rule.severity},
        "annotations": {"summary": rule.summary, "first_response": rule.first_response},
    }


def rules_document(rules: Sequence[AlertRule] = ALERTS) -> dict[str, Any]:
    return {
        "groups": [{"name": "kvguard", "interval": "15s", "rules": [rule_json(r) for r in rules]}]
    }


def alert_table(rules: Sequence[AlertRule] = ALERTS) -> str:
    """The alert table of docs/operations.md: name, severity, when it fires, first response."""
    rows = ["| Alert | Severity | Fires when | First response |", "|---|---|---|---|"]
    for r in rules:
        when = r.summary + (f" (for {r.for_})" if r.for_ != "0m" else "")
        rows.append(f"| `{r.name}` | {r.severity} | {when} | {r.first_response} |")
    return "\n".join(rows) + "\n"


def scrape_config(
    targets: Sequence[ScrapeTarget], rule_files: Sequence[str], interval: str = "15s"
) -> dict[str, Any]:
    """A prometheus.yml scraping each target's /metrics, one static config per target."""
    jobs: dict[str, list[dict[str, Any]]] = {}
    for t in targets:
        jobs.setdefault(t.job, []).append({"targets": [t.address], "labels": dict(t.labels)})
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": list(rule_files),
        "scrape_configs": [
            {"job_name": job, "metrics_path": "/metrics", "static_configs": configs}
            for job, configs in jobs.items()
        ],
    }


def engine_targets(engine: str, roles: Sequence[tuple[str, str]]) -> list[ScrapeTarget]:
    """An engine's roles as targets: ``roles`` = [(role, host:port)], labelled engine + role."""
    return [
        ScrapeTarget("kvguard-engine", address, (("engine", engine), ("role", role)))
        for role, address in roles
    ]


# -- the compose topology's Prometheus and Grafana files -------------------------------------------

COMPOSE_ENGINE = "bundled"  # the name the gateway routes by (KVGUARD_ENGINES in compose.yaml)
# compose.yaml's ``metrics_token`` secret (KVGUARD_METRICS_TOKEN): the gateway's /metrics holds
# every tenant's series and answers only this bearer credential (or the admin token).
COMPOSE_METRICS_TOKEN_FILE = "/run/secrets/metrics_token"
COMPOSE_ALERTMANAGER = "alertmanager:9093"  # compose.yaml's alertmanager service


def compose_prometheus() -> dict[str, Any]:
    targets = [
        ScrapeTarget("kvguard-gateway", "gateway:8000"),
        *engine_targets(COMPOSE_ENGINE, [("prefill", "prefill:8100"), ("decode", "decode:8100")]),
        ScrapeTarget("otel-collector", "otel-collector:8888"),
    ]
    config = scrape_config(targets, ["/etc/prometheus/rules/alerts.yml"])
    # Every gateway replica, not whichever one "gateway" resolves to: Docker's DNS lists them all.
    gateway_job = config["scrape_configs"][0]
    del gateway_job["static_configs"]
    gateway_job["dns_sd_configs"] = [{"names": ["gateway"], "type": "A", "port": 8000}]
    gateway_job["authorization"] = {
        "type": "Bearer",
        "credentials_file": COMPOSE_METRICS_TOKEN_FILE,
    }
    config["alerting"] = alerting([COMPOSE_ALERTMANAGER])
    return config


def alerting(alertmanagers: Sequence[str]) -> dict[str, Any]:
    """prometheus.yml's ``alerting`` block: send firing rules to these Alertmanagers (host:port)."""
    return {"alertmanagers": [{"static_configs": [{"targets": list(alertmanagers)}]}]}


def grafana_datasource() -> dict[str, Any]:
    source = {
        "name": "Prometheus",
        "type": "prometheus",
        "uid": DATASOURCE_UID,
        "access": "proxy",
        "url": "http://prometheus:9090",
        "isDefault": True,
    }
    return {"apiVersion": 1, "datasources": [source]}


def grafana_dashboards_provider() -> dict[str, Any]:
    provider = {
        "name": "kvguard",
        "type": "file",
        "folder": "kvguard",
        "disableDeletion": True,
        "allowUiUpdates": False,
        "options": {"path": "/var/lib/grafana/dashboards"},
    }
    return {"apiVersion": 1, "providers": [provider]}


def _yaml(data: dict[str, Any]) -> str:
    header = "# Generated by `python -m dashboards.build`; edit dashboards/*.py, not this file.\n"
    return header + yaml.safe_dump(data, sort_keys=False, width=100)


def rendered() -> dict[Path, str]:
    """Every generated file and its content."""
    files = {
        ROOT / "grafana" / f"{d.uid}.json": json.dumps(
            dashboard_json(d, VARIABLE_QUERIES), indent=2
        )
        + "\n"
        for d in DASHBOARDS
    }
    files[RULES_FILE] = _yaml(rules_document())
    files[ROOT / "provisioning" / "datasources" / "kvguard.yml"] = _yaml(grafana_datasource())
    files[ROOT / "provisioning" / "dashboards" / "kvguard.yml"] = _yaml(
        grafana_dashboards_provider()
    )
    files[REPO / "deploy" / "prometheus.yml"] = _yaml(compose_prometheus())
    return files


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.build", description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if a committed file is stale")
    args = parser.parse_args(argv)
    stale = []
    for path, content in rendered().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == content:
            continue
        if args.check:
            stale.append(str(path.relative_to(REPO)))
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content, encoding="utf-8")
        print(f"wrote {path.relative_to(REPO)}")
    if stale:
        print("stale (run python -m dashboards.build):", *stale, sep="\n  ", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
