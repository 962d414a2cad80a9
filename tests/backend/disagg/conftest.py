"""Fixtures for the disaggregation tests: real prefill/decode processes on 127.0.0.1."""

from __future__ import annotations

import sys
from pathlib import Path

# Test modules are imported in importlib mode (sys.path untouched): make the harness importable.
sys.path.insert(0, str(Path(__file__).parent))
