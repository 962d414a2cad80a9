"""The handoff's logic modules stay pure: the model checker imports them without torch or HTTP."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PURE = ["protocol", "wire", "machines", "faults", "errors", "decode_scheduler"]
ALLOWED_STDLIB = {"__future__", "collections", "dataclasses", "enum", "types", "typing"}


def test_pure_modules_import_only_stdlib_core_and_each_other() -> None:
    for name in PURE:
        tree = ast.parse((REPO / "backend" / "disagg" / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                module = node.module
            elif isinstance(node, ast.Import):
                module = node.names[0].name
            else:
                continue
            top = module.split(".")[0]
            pure = module.startswith("backend.core") or any(
                module == f"backend.disagg.{other}" for other in PURE
            )
            assert top in ALLOWED_STDLIB or pure, f"{name}.py imports {module}"


def test_importing_them_loads_no_heavy_packages() -> None:
    modules = ", ".join(f"backend.disagg.{name}" for name in PURE)
    probe = (
        f"import sys, {modules}; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'torch', 'numpy', 'fastapi', 'httpx', 'pydantic', 'mooncake'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
