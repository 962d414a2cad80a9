"""The configuration reference names every field of every settings class, as its variable, and
docs/configuration.md holds its current output."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from backend.config import BackendSettings
from canary.config import CanarySettings
from gateway.config import GatewaySettings
from gateway.engines.spec import EngineSpec
from kvguard.configdoc import render

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_reference_lists_every_variable_once_per_section() -> None:
    text = render()
    sections = text.split("\n### ")[1:]
    assert len(sections) == 4
    classes = (BackendSettings, GatewaySettings, CanarySettings)
    for section, settings in zip(sections, classes, strict=False):
        rows = [line for line in section.splitlines() if line.startswith("| `")]
        names = [row.split("`")[1] for row in rows]
        assert names == [f"KVGUARD_{f.upper()}" for f in settings.model_fields]
    engine_rows = [line for line in sections[3].splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in engine_rows] == list(EngineSpec.model_fields)
    assert "/work/" not in text and "/home/" not in text  # no build-machine paths


def test_every_row_says_what_the_setting_means() -> None:
    rows = [line for line in render().splitlines() if line.startswith("| `")]
    cells = [re.split(r"(?<!\\)\|", row)[1:-1] for row in rows]  # escaped pipes stay in cells
    assert {len(row) for row in cells} == {4}
    unexplained = [variable.strip() for variable, _, _, meaning in cells if not meaning.strip()]
    assert unexplained == []
    assert "Annotated[" not in render()  # types read as types, not as their constraints


def test_the_docs_hold_the_current_reference() -> None:
    """A settings field added, renamed or re-described without regenerating fails here."""
    text = render()
    assert text.startswith("## Configuration reference\n") and "\n### Gateway " in text
    page = PAGE.read_text(encoding="utf-8")
    assert text in page, "stale: paste `python -m kvguard.configdoc` into docs/configuration.md"


def test_module_runs_as_a_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvguard.configdoc", "--level", "3"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout == render(level=3)
