"""Fixtures of the operations tests (dashboards, alerts, compose, production-like profile)."""

from __future__ import annotations

import sys
from pathlib import Path

# Test modules are imported in importlib mode (sys.path untouched): make the helpers importable.
sys.path.insert(0, str(Path(__file__).parent))
