"""The committed dashboards and rules are what the code renders, name only real metrics, and pass
``promtool check rules``; docs/operations.md's alert table is the rules' own text; every dashboard
validates against Grafana's published schema, reads its Prometheus through a datasource variable,
and survives Grafana's UI import into a Grafana provisioned differently from ours."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from backend import metrics as em
from canary import metrics as cm
from dashboards import build, engines, grafana_json
from dashboards.alerts import ALERTS
from dashboards.catalog import DASHBOARDS
from gateway import metrics as gm

METRIC = re.compile(r"\bkvguard_[a-z_]+")
THIRD_PARTY = re.compile(r"\b(?:vllm|sglang):[a-z0-9_]+")
FIXTURES = Path(__file__).parent / "fixtures"
IMPORT_ENVELOPE = ("__inputs", "__requires")


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


def test_the_docs_alert_table_matches_the_rules() -> None:
    page = (build.REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    table = build.alert_table()
    assert table.count("\n| `Kvguard") == len(ALERTS)
    assert table in page, "stale: paste dashboards.build.alert_table() into docs/operations.md"


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


def _committed(dashboard_uid: str) -> dict[str, Any]:
    return dict(json.loads((build.ROOT / "grafana" / f"{dashboard_uid}.json").read_text()))


def _strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for v in node.values() for s in _strings(v)]
    if isinstance(node, list):
        return [s for v in node for s in _strings(v)]
    return []


def test_every_query_reads_the_datasource_variable() -> None:
    """No panel names a datasource uid: provisioning starts the variable on the default
    Prometheus (compose provisions kvguard-prometheus as the default)."""
    for dashboard in DASHBOARDS:
        data = _committed(dashboard.uid)
        assert data["uid"] == dashboard.uid
        assert [p["title"] for p in data["panels"]] == [p.title for p in dashboard.panels]
        variable = data["templating"]["list"][0]
        assert (variable["name"], variable["type"], variable["query"]) == (
            "datasource",
            "datasource",
            "prometheus",
        )
        sources = [p["datasource"] for p in data["panels"]]
        sources += [t["datasource"] for p in data["panels"] for t in p["targets"]]
        sources += [v["datasource"] for v in data["templating"]["list"][1:]]
        assert all(p["targets"] for p in data["panels"])
        assert {json.dumps(s) for s in sources} == {json.dumps(grafana_json.DATASOURCE)}
        assert build.DATASOURCE_UID not in json.dumps(data)
    source = build.grafana_datasource()["datasources"][0]
    assert source["uid"] == build.DATASOURCE_UID and source["isDefault"] is True


def _grafana_import(data: dict[str, Any], chosen: dict[str, str]) -> dict[str, Any]:
    """What Grafana's import does with a dashboard file (pkg/services/dashboardimport, read for its
    behaviour): every ``__inputs`` entry must be answered; ``${NAME}`` of an input is replaced in
    every string by the answer (a datasource input: the chosen datasource's uid); the envelope is
    dropped. Anything else in ``${...}`` is left for the dashboard's own variables."""
    missing = {i["name"] for i in data["__inputs"]} - set(chosen)
    assert not missing, f"import would fail: no value for {missing}"

    def fill(node: Any) -> Any:
        if isinstance(node, str):
            return re.sub(r"\$\{(\w+)\}", lambda m: chosen.get(m.group(1), m.group(0)), node)
        if isinstance(node, dict):
            return {k: fill(v) for k, v in node.items()}
        if isinstance(node, list):
            return [fill(v) for v in node]
        return node

    return {k: fill(v) for k, v in data.items() if k not in IMPORT_ENVELOPE}


def test_ui_import_binds_every_panel_to_the_prometheus_the_user_picks() -> None:
    for dashboard in DASHBOARDS:
        data = _committed(dashboard.uid)
        (source,) = data["__inputs"]
        assert (source["type"], source["pluginId"]) == ("datasource", "prometheus")
        requires = {(r["type"], r["id"]) for r in data["__requires"]}
        assert {("grafana", "grafana"), ("datasource", "prometheus")} <= requires
        assert {("panel", p.kind) for p in dashboard.panels} <= requires
        imported = _grafana_import(data, {source["name"]: "their-prometheus-uid"})
        variable = imported["templating"]["list"][0]
        assert variable["current"]["value"] == "their-prometheus-uid", variable
        names = {v["name"] for v in imported["templating"]["list"]}
        left = {m for s in _strings(imported) for m in re.findall(r"\$\{(\w+)\}", s)}
        assert left <= names, left - names  # only the dashboard's own variables remain


def test_every_dashboard_matches_grafanas_published_schema() -> None:
    """Grafana's dashboard schema (@grafana/schema, the version compose runs, vendored as JSON
    Schema: tests/ops/fixtures/README.md), for every committed dashboard minus the import
    envelope; the schema is strict enough to catch a misspelt field or a wrong type."""
    schema = json.loads((FIXTURES / "grafana_dashboard_schema.json").read_text())
    assert "@grafana/schema@" + grafana_json.GRAFANA_VERSION in schema["$comment"]
    validator = jsonschema.Draft7Validator(schema)
    for dashboard in DASHBOARDS:
        data = {k: v for k, v in _committed(dashboard.uid).items() if k not in IMPORT_ENVELOPE}
        errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(data)]
        assert errors == [], (dashboard.uid, errors[:5])
    broken = {k: v for k, v in _committed(DASHBOARDS[0].uid).items() if k not in IMPORT_ENVELOPE}
    assert not validator.is_valid({**broken, "schemaVersion": "39"})
    assert not validator.is_valid({**broken, "panels": [{**broken["panels"][0], "titel": "x"}]})
    assert not validator.is_valid({**broken, "templating": {"list": [{"name": "x"}]}})


def test_engine_panels_name_only_what_sglang_and_vllm_export() -> None:
    """Every vllm:/sglang: series a query reads is in the stand-in expositions built from the
    engines' own metric definitions (tests/ops/fixtures/README.md)."""
    exported = {
        sample.split("{")[0].split(" ")[0]
        for name in ("third_party_vllm_metrics.txt", "third_party_sglang_metrics.txt")
        for sample in (FIXTURES / name).read_text().splitlines()
        if sample and not sample.startswith("#")
    }
    exported |= {n.removesuffix("_bucket") for n in exported}
    exprs = [q.expr for d in DASHBOARDS for p in d.panels for q in p.queries]
    used = {name for expr in exprs for name in THIRD_PARTY.findall(expr)}
    used = {n.removesuffix("_bucket") for n in used}
    assert used == set(engines.METRIC_NAMES)
    assert used - exported == set()


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
