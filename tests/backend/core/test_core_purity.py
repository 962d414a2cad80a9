"""backend.core stays pure bookkeeping: standard-library imports only, no torch/HTTP/env/I/O."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
CORE = REPO / "backend" / "core"
# hashlib/hmac/struct: the prefix cache's keys (pure computation on bytes)
ALLOWED_STDLIB = {
    *("__future__", "collections", "dataclasses", "enum", "math", "types", "typing"),
    *("hashlib", "hmac", "struct"),
}
PURE_CONTRACTS = {"contracts.capacity", "contracts.errors", "contracts.lifecycle"}
FORBIDDEN_CALLS = {"open", "getenv", "environ", "print", "input"}


def imported_modules(path: Path) -> set[str]:
    modules: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            modules.add(node.module)
    return modules


def test_core_modules_import_only_stdlib_and_core() -> None:
    files = sorted(CORE.glob("*.py"))
    assert {f.name for f in files} >= {"errors.py", "pages.py", "request.py", "scheduler.py"}
    for path in files:
        for module in imported_modules(path):
            top = module.split(".")[0]
            pure_contract = module in PURE_CONTRACTS
            allowed = top in ALLOWED_STDLIB or module.startswith("backend.core") or pure_contract
            assert allowed, f"{path.name} imports {module}"


def test_the_contracts_core_imports_are_pure_too() -> None:
    for contract in sorted(PURE_CONTRACTS):
        path = REPO / (contract.replace(".", "/") + ".py")
        for module in imported_modules(path):
            allowed = module.split(".")[0] in ALLOWED_STDLIB or module in PURE_CONTRACTS
            assert allowed, f"{contract} imports {module}"


def test_core_modules_touch_no_environment_or_files() -> None:
    for path in sorted(CORE.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
            assert name not in FORBIDDEN_CALLS, f"{path.name} uses {name}"


def test_importing_core_loads_no_heavy_or_io_packages() -> None:
    probe = (
        "import sys, backend.core; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'numpy', 'fastapi', 'starlette', 'httpx', 'pydantic', 'redis', 'sqlalchemy'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
