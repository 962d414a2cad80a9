"""The import directions between kvguard's packages, read from every module's imports (``ast``,
function-level imports included), and checked at run time in a fresh interpreter.

    kvguard (the roof: CLI, supervisor, demo)  ->  anything
    backend, gateway, canary (the deployables)  ->  contracts
    contracts                                   ->  nothing of ours

- ``contracts`` imports no package of ours but itself;
- ``backend`` imports ``contracts`` and itself only;
- ``gateway`` imports ``contracts``, ``migrations`` (its schema history) and itself only;
- ``canary`` imports ``contracts`` and itself; only its findings API router (``canary/api.py``)
  imports the gateway, through the surface a plug-in router mounts on (``ROUTER_SURFACE``: the
  auth dependencies, error types and field types every gateway route uses);
- ``migrations`` imports ``contracts``, and the deployables' table modules only to compare them;
- no deployable imports ``kvguard``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OURS = {"contracts", "backend", "gateway", "canary", "kvguard", "migrations", "dashboards", "bench"}
ALLOWED = {
    "contracts": {"contracts"},
    "backend": {"contracts", "backend"},
    "gateway": {"contracts", "gateway", "migrations"},
    "canary": {"contracts", "canary"},
    "migrations": {"contracts", "migrations"},
}
ROUTER_SURFACE = {"gateway.deps", "gateway.errors", "gateway.api.timestamps", "gateway.db.text"}
EXCEPTIONS = {
    "canary/api.py": ROUTER_SURFACE,
    "migrations/env.py": {"gateway.db.models", "canary.findings"},  # autogenerate's comparison
}


def imports_of(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def violations(package: str, root: Path = REPO) -> list[str]:
    found = []
    for path in sorted((root / package).rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.startswith("migrations/versions/"):
            continue  # revisions import alembic and sqlalchemy only (checked below anyway)
        allowed_here = EXCEPTIONS.get(relative, set())
        for module in sorted(imports_of(path)):
            top = module.split(".")[0]
            if top not in OURS or top in ALLOWED[package]:
                continue
            if any(module == ok or module.startswith(f"{ok}.") for ok in allowed_here):
                continue
            parent = module.rsplit(".", 1)[0]
            if parent in allowed_here:  # ``from gateway.deps import AdminDep``
                continue
            found.append(f"{relative} imports {module}")
    return found


def test_contracts_import_no_deployable() -> None:
    assert {p.name for p in (REPO / "contracts").glob("*.py")} >= {
        "engine.py",
        "chat_format.py",
        "http_edge.py",
        "openai.py",
        "plugins.py",
        "settings.py",
        "sql.py",
        "sse.py",
    }
    assert violations("contracts") == []


def test_deployables_import_each_other_only_in_the_allowed_directions() -> None:
    packages = ("backend", "gateway", "canary", "migrations")
    assert [v for package in packages for v in violations(package)] == []


def test_the_checker_reports_each_kind_of_crossing(tmp_path: Path) -> None:
    """The rules are not vacuous: imports across them, at any depth, are reported."""
    files = {
        "contracts/leaky.py": "from gateway.state import x\n",
        "canary/reach.py": "def f():\n    from gateway.proxy.side import side_fields\n",
        "canary/api.py": "from gateway.deps import AdminDep\nfrom gateway.state import S\n",
        "backend/up.py": "import kvguard.cli\n",
        "gateway/down.py": "from backend.bundled import chat\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = [
        v
        for package in ALLOWED
        if (tmp_path / package).exists()
        for v in violations(package, tmp_path)
    ]
    assert sorted(found) == [
        "backend/up.py imports kvguard.cli",
        "canary/api.py imports gateway.state",
        "canary/api.py imports gateway.state.S",
        "canary/reach.py imports gateway.proxy.side",
        "canary/reach.py imports gateway.proxy.side.side_fields",
        "contracts/leaky.py imports gateway.state",
        "contracts/leaky.py imports gateway.state.x",
        "gateway/down.py imports backend.bundled",
        "gateway/down.py imports backend.bundled.chat",
    ]


def _loaded_after(statement: str) -> list[str]:
    probe = (
        f"import sys; {statement}; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'backend', 'gateway', 'canary', 'kvguard', 'migrations'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    return eval(result.stdout.strip())  # a printed list of names


def test_importing_every_contract_loads_no_deployable() -> None:
    modules = sorted(p.stem for p in (REPO / "contracts").glob("*.py") if p.stem != "__init__")
    statement = "; ".join(f"import contracts.{m}" for m in modules)
    assert _loaded_after(statement) == []


def test_a_gateway_migrating_its_database_loads_no_canary_code(tmp_path: Path) -> None:
    """The runtime loop gateway.db.session -> migrations/env.py -> canary.findings is gone."""
    url = f"sqlite:///{tmp_path / 'kvguard.db'}"
    statement = (
        "from gateway.db.session import make_engine, upgrade_database; "
        f"upgrade_database(make_engine({url!r}))"
    )
    loaded = _loaded_after(statement)
    assert "gateway" in loaded and "migrations" in loaded
    assert "canary" not in loaded and "backend" not in loaded
