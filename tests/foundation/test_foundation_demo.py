"""`kvguard demo` tells the whole story on real processes and exits 0 only when it held.

The end-to-end test runs the command as a user would (the bundled model, four local processes)
and reads its narrative; the verdict tests pin which outcomes count as "the story held".
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvguard import drillstack
from kvguard.demo import Probe, Story
from kvguard.drillstack import Act, Exchange

BUNDLED_MODEL = Path(drillstack.__file__).resolve().parents[1] / "backend" / "bundled"
MARKER = re.compile(r"CNRY-[A-Z2-7]{32}")


@pytest.mark.slow
@pytest.mark.skipif(
    not (BUNDLED_MODEL / "kvguard-tiny").is_dir(), reason="the leak needs the bundled model"
)
def test_the_demo_catches_the_leak_then_refuses_and_exits_0(tmp_path: Path) -> None:
    env = {**os.environ, "KVGUARD_TORCH_THREADS": "1"}
    argv = [sys.executable, "-m", "kvguard", "demo", "--work-dir", str(tmp_path)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=420)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "1 incident     drill    200       200, stream cut: isolation_violation" in out
    assert "2 defences on  guarded  200       400 context_length_exceeded" in out
    assert re.search(r"finding   #\d+ cross_tenant / critical on engine", out), out
    assert "engine    'drill' quarantined" in out
    assert re.search(r"probe +canary echo probe on 'guarded' +-> pass", out), out
    assert "the story held" in out
    # ids and codes only: no marker, no prompt text (B's prompt is a run of "x")
    assert MARKER.search(out) is None and "xxxxxxxx" not in out
    gateway = re.search(r"gateway   (http://127\.0\.0\.1:\d+)", out)
    assert gateway is not None, out
    with pytest.raises(httpx.ConnectError):  # every role was stopped at exit
        httpx.get(gateway.group(1) + "/health", timeout=2)
    assert {p.name for p in tmp_path.glob("*.log")} == {
        "drill-prefill.log",
        "drill-decode.log",
        "guarded.log",
        "gateway.log",
    }


def _exchange(status: int, *codes: str, request_id: str = "r", marker: bool = False) -> Exchange:
    return Exchange(status, request_id, codes, text_chars=3, marker_seen=marker)


def _story(**changes: Any) -> Story:
    """The outcome the demo expects: B cut and found on drill, B refused on guarded."""
    finding = {
        "kind": "cross_tenant",
        "severity": "critical",
        "victim_tenant_id": "tenant-a-id",
        "victim_request_id": "a1",
    }
    story = Story(
        a_id="tenant-a-id",
        incident=Act("drill", _exchange(200, request_id="a1"), _exchange(200, drillstack.CUT_CODE)),
        finding=finding,
        quarantine="canary: isolation finding on request b1",
        guarded=Act("guarded", _exchange(200), _exchange(400, drillstack.REFUSED_CODE)),
        probe=Probe(True, "200, own marker echoed, 0 other"),
    )
    return replace(story, **changes)


def test_the_expected_outcome_holds() -> None:
    story = _story()
    assert (story.leak_caught(), story.refused()) == (True, True)


@pytest.mark.parametrize(
    "changes",
    [
        {"finding": None},
        {"quarantine": None},
        {
            "finding": {
                "kind": "cross_tenant",
                "severity": "critical",
                "victim_tenant_id": "tenant-a-id",
                "victim_request_id": "other",
            }
        },
        {"incident": Act("drill", _exchange(200, request_id="a1"), _exchange(200))},
        {
            "incident": Act(
                "drill",
                _exchange(200, request_id="a1"),
                _exchange(200, drillstack.CUT_CODE, marker=True),
            )
        },
    ],
    ids=["no-finding", "not-quarantined", "wrong-victim", "not-cut", "marker-reached-b"],
)
def test_a_leak_not_caught_fails_the_story(changes: dict[str, Any]) -> None:
    story = _story(**changes)
    assert (story.leak_caught(), story.refused()) == (False, True)


@pytest.mark.parametrize(
    "changes",
    [
        {"guarded": Act("guarded", _exchange(200), _exchange(200))},
        {"guarded": Act("guarded", _exchange(200), _exchange(400, "invalid_request"))},
        {"probe": Probe(False, "200, own marker missing, 0 other")},
    ],
    ids=["b-served", "other-refusal", "probe-failed"],
)
def test_defences_that_do_not_refuse_fail_the_story(changes: dict[str, Any]) -> None:
    story = _story(**changes)
    assert (story.leak_caught(), story.refused()) == (True, False)
