"""A ``dashboards.spec.Dashboard`` as Grafana dashboard JSON, for provisioning and for UI import.

Every panel, query and query variable reads its Prometheus through the ``datasource`` template
variable, so one file serves both ways in:
- provisioning (compose's Grafana): the variable starts on the default Prometheus datasource (the
  provisioned ``kvguard-prometheus``); the ``__inputs``/``__requires`` keys are ignored;
- UI import into any Grafana (Dashboards > New > Import): Grafana asks for the ``DS_PROMETHEUS``
  input declared in ``__inputs`` and substitutes the chosen datasource for ``${DS_PROMETHEUS}``,
  which is where the variable starts. The variable stays switchable afterwards.

The JSON validates against Grafana's published dashboard schema (``@grafana/schema``), which
tests/ops/test_ops_dashboards.py checks; ``__inputs``/``__requires`` are the import envelope
Grafana's own "Export for sharing externally" writes around that schema.
"""

from __future__ import annotations

from typing import Any

from dashboards.spec import Dashboard, Panel

GRAFANA_VERSION = "11.2.0"  # compose.yaml's grafana/grafana-oss image
DATASOURCE_VARIABLE = "datasource"
DATASOURCE_INPUT = "DS_PROMETHEUS"
DATASOURCE = {"type": "prometheus", "uid": "${" + DATASOURCE_VARIABLE + "}"}
GRID_WIDTH, PANEL_W, PANEL_H = 24, 12, 8
PANEL_NAMES = {"timeseries": "Time series", "stat": "Stat", "table": "Table"}


def panel_json(panel: Panel, index: int) -> dict[str, Any]:
    targets = [
        {
            "refId": chr(ord("A") + i),
            "datasource": DATASOURCE,
            "expr": q.expr,
            "legendFormat": q.legend,
            "instant": q.instant,
            "range": not q.instant,
            **({"format": "table"} if panel.kind == "table" else {}),
        }
        for i, q in enumerate(panel.queries)
    ]
    x = (index % (GRID_WIDTH // PANEL_W)) * PANEL_W
    y = (index // (GRID_WIDTH // PANEL_W)) * PANEL_H
    return {
        "id": index + 1,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": PANEL_W, "h": PANEL_H},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {},
        "targets": targets,
    }


def datasource_variable() -> dict[str, Any]:
    """The Prometheus every query reads; starts on the import's choice (or the default)."""
    start = "${" + DATASOURCE_INPUT + "}"
    return {
        "name": DATASOURCE_VARIABLE,
        "label": "Prometheus",
        "type": "datasource",
        "query": "prometheus",
        "regex": "",
        "refresh": 1,
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "options": [],
        "current": {"text": start, "value": start},
    }


def query_variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": name},
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "refresh": 2,
        "current": {"text": "All", "value": "$__all"},
    }


def import_envelope(dashboard: Dashboard) -> dict[str, Any]:
    """``__inputs`` (what Grafana's import asks for) and ``__requires`` (what it needs)."""
    source = {
        "name": DATASOURCE_INPUT,
        "label": "Prometheus",
        "description": "The Prometheus that scrapes the kvguard gateway and engines",
        "type": "datasource",
        "pluginId": "prometheus",
        "pluginName": "Prometheus",
    }
    requires = [
        {"type": "grafana", "id": "grafana", "name": "Grafana", "version": GRAFANA_VERSION},
        {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
    ]
    for kind in sorted({p.kind for p in dashboard.panels}):
        requires.append({"type": "panel", "id": kind, "name": PANEL_NAMES[kind], "version": ""})
    return {"__inputs": [source], "__requires": requires}


def dashboard_json(dashboard: Dashboard, variable_queries: dict[str, str]) -> dict[str, Any]:
    variables = [datasource_variable()]
    variables += [query_variable(v, variable_queries[v]) for v in dashboard.variables]
    return {
        **import_envelope(dashboard),
        "id": None,
        "uid": dashboard.uid,
        "title": dashboard.title,
        "tags": ["kvguard"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": variables},
        "panels": [panel_json(p, i) for i, p in enumerate(dashboard.panels)],
    }
