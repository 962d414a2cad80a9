"""The committed dashboards and rules are what the code renders, name only real metrics, and pass
``promtool check rules``; the README's alert table is the rules' own text."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import yaml

from backend import metrics as em
from canary import metrics as cm
from dashboards import build
from dashboards.alerts import ALERTS
from dashboards.catalog import DASHBOARDS
from gateway import metrics as gm

METRIC = re.compile(r"\bkvguard_[a-z_]+")


def _exported_names() -> set[str]:
    """Every series name the three metric modules can expose (counters gain ``_total``,
    histograms ``_bucket``/``_sum``/``_count``)."""
    names: set[str] = set()
    for module in (em, gm, cm):
        for value in vars(module).values():
            if isinstance(value, str) and value.startswith("kvguard_") and value != em.PREFIX:
                base = value.removesuffix("_total")
                names |= {value, base + "_total", base + "_bucket", base + "_sum", base + "_count"}
    return names


def test_committed_files_match_the_generator() -> None:
    assert build.main(["--check"]) == 0


def test_readme_alert_table_matches_the_rules() -> None:
    readme = (build.REPO / "README.md").read_text(encoding="utf-8")
    table = build.alert_table()
    assert table.count("\n| `Kvguard") == len(ALERTS)
    assert table in readme, "stale: paste dashboards.build.alert_table() into README's Alerts"


def test_rules_pass_promtool() -> None:
    done = subprocess.run(
        ["promtool", "check", "rules", str(build.RULES_FILE)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in done.stdout


def _series(metric: str, **labels: str) -> dict[str, str]:
    body = ", ".join(f'{k}="{v}"' for k, v in labels.items())
    return {"series": f"{metric}{{{body}}}", "values": "1x5"}


def test_fault_drill_alert_is_scoped_to_production(tmp_path: Path) -> None:
    """``promtool test rules``: drills on a production-mode engine alert, on a development-mode
    one they do not, and drills the gateway sees on an engine nobody scrapes alert (mode unknown).
    """
    rule = next(r for r in ALERTS if r.name == "KvguardFaultDrillEnabled")
    drill = {"fault": "skip_checksum"}
    series = [
        _series(em.FAULT_DRILL, engine="prod", role="decode", **drill),
        _series(em.MODE, engine="prod", role="decode", mode="production"),
        _series(em.FAULT_DRILL, engine="lab", role="decode", **drill),
        _series(em.MODE, engine="lab", role="decode", mode="development"),
        *(_series(gm.ENGINE_FAULT_DRILLS, engine=e) for e in ("prod", "lab", "unscraped")),
    ]
    annotations = {"summary": rule.summary, "first_response": rule.first_response}
    expected = [
        {"severity": "critical", "engine": "prod", "role": "decode", **drill},
        {"severity": "critical", "engine": "unscraped"},
    ]
    alert_test = {
        "eval_time": "2m",
        "alertname": rule.name,
        "exp_alerts": [{"exp_labels": e, "exp_annotations": annotations} for e in expected],
    }
    spec = {
        "rule_files": [str(build.RULES_FILE)],
        "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": [alert_test]}],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(spec))
    done = subprocess.run(
        ["promtool", "test", "rules", str(tmp_path / "test.yml")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_query_names_only_exported_metrics() -> None:
    exported = _exported_names()
    exprs = [q.expr for d in DASHBOARDS for p in d.panels for q in p.queries]
    exprs += [r.expr for r in ALERTS]
    used = {name for expr in exprs for name in METRIC.findall(expr)}
    assert used - exported == set()
    assert len(used) > 30  # sanity: the regex really finds the names


def test_dashboard_json_is_provisionable() -> None:
    for dashboard in DASHBOARDS:
        path = build.ROOT / "grafana" / f"{dashboard.uid}.json"
        data = json.loads(path.read_text())
        assert data["uid"] == dashboard.uid
        assert [p["title"] for p in data["panels"]] == [p.title for p in dashboard.panels]
        for panel in data["panels"]:
            assert panel["targets"], panel["title"]
            assert all(t["datasource"]["uid"] == build.DATASOURCE_UID for t in panel["targets"])
    source = build.grafana_datasource()["datasources"][0]
    assert source["uid"] == build.DATASOURCE_UID


def test_every_variable_a_query_uses_is_declared() -> None:
    """A ``$tenant`` in a dashboard without the tenant variable would reach Prometheus as is."""
    for dashboard in DASHBOARDS:
        used = {
            name
            for p in dashboard.panels
            for q in p.queries
            for name in re.findall(r"\$(tenant|engine)\b", q.expr)
        }
        assert used <= set(dashboard.variables), (dashboard.uid, used)
