"""Fixtures of the operations tests (dashboards, alerts, compose, production-like profile)."""

from __future__ import annotations

import sys
from pathlib import Path

# Test modules are imported in importlib mode (sys.path untouched): make the helpers importable,
# ours and the gateway tests' stand-in engine (helper module names are unique across the tree).
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).parents[1] / "gateway"))
