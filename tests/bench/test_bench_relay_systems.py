"""The relay benchmark's processes (``bench.relay_systems.Systems``): a benchmark that is killed
still stops what it started."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

_KILLED_BENCHMARK = """
import signal, tempfile
from pathlib import Path
from bench.relay_systems import Systems

with tempfile.TemporaryDirectory() as tmp:
    systems = Systems(Path(tmp))
    try:
        systems.standin(engines=1, interval_s=0.01)
        print(systems.standin_pid, flush=True)
        signal.pause()  # a benchmark at work, until it is killed
    finally:
        systems.close()
"""


def test_a_benchmark_killed_with_sigterm_stops_what_it_started() -> None:
    """Killed, a benchmark still stops its stand-in (and Redis, PostgreSQL, relays): left running,
    they would share the machine with the next benchmark's measurements."""
    bench = subprocess.Popen(
        [sys.executable, "-c", _KILLED_BENCHMARK], stdout=subprocess.PIPE, text=True
    )
    try:
        assert bench.stdout is not None
        standin = int(bench.stdout.readline())
        assert Path(f"/proc/{standin}").exists()
        bench.terminate()  # SIGTERM
        assert bench.wait(timeout=30) == 143
        deadline = time.monotonic() + 30
        while _running(standin):
            assert time.monotonic() < deadline, "the stand-in outlived its benchmark"
            time.sleep(0.05)
    finally:
        bench.kill()
        bench.wait()


def _running(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
