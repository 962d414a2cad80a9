"""Responses tests import their helpers by module name (importlib mode leaves sys.path alone)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
