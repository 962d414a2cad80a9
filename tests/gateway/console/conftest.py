"""Console test fixtures: this directory's helper module (``console_harness``) on the path."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
