"""One definition per concept (the ones a reader once found twice): each is defined in exactly
one module of the tree, and the names it replaced are gone."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("contracts", "backend", "gateway", "canary", "kvguard", "migrations", "dashboards")
ONE_HOME = {
    "HandoffProof": "contracts/engine.py",  # was also backend/disagg/machines.py,
    # gateway/proxy/context.py and backend/server/openai_schema.py
    "FindingKind": "canary/kinds.py",  # was also canary/scanner.py
    "Evidence": "canary/kinds.py",  # canary/scanner.py called it Severity
    "FindingSeverity": "canary/kinds.py",
    "RoleCapacity": "contracts/engine.py",
    "CapacityReport": "contracts/engine.py",  # extends RoleCapacity, no longer repeats it
    "path_max_request_tokens": "contracts/capacity.py",  # the minimum over roles
    "drift_message": "contracts/capacity.py",  # the drift statement
    "check_move": "contracts/lifecycle.py",  # the transition check (was by hand in the gateway
    # and the canary, and backend/core/lifecycle.py)
    "Machine": "contracts/lifecycle.py",
    "InvalidTransition": "contracts/lifecycle.py",  # was also gateway/lifecycle.py
    "KvguardError": "contracts/errors.py",
}
GONE = {"Severity", "parse_handoff", "enforceable_limit", "limit_for", "_holds"}


def definitions() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                    found.setdefault(node.name, []).append(path.relative_to(REPO).as_posix())
    return found


def test_each_concept_has_one_definition() -> None:
    found = definitions()
    assert {name: found.get(name) for name in ONE_HOME} == {
        name: [home] for name, home in ONE_HOME.items()
    }


def test_the_old_names_are_gone() -> None:
    found = definitions()
    assert {name: found[name] for name in GONE if name in found} == {}
