"""`kvguard demo` tells the whole story on real processes and exits 0 only when it held.

The end-to-end test runs the command as a user would (the bundled model, four local processes)
and reads its narrative: the steps in the issue's order (two tenants chat, a probe passes, the
capacity check refuses, the incident is replayed and caught, a summary and the Grafana pointers).
The verdict tests pin which outcomes count as "the story held".
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
from kvguard.demo import Probe, Story, grafana_pointers
from kvguard.drillstack import Act, Exchange

BUNDLED_MODEL = Path(drillstack.__file__).resolve().parents[1] / "backend" / "bundled"
MARKER = re.compile(r"CNRY-[A-Z2-7]{32}")
STEPS = (  # after "Starting the drill stack", as the issue tells the story
    "Two tenants chat",
    "A canary probe",
    "The capacity check",
    "The incident's deployment",
    "Summary",
)


@pytest.mark.slow
@pytest.mark.skipif(
    not (BUNDLED_MODEL / "kvguard-tiny").is_dir(), reason="the leak needs the bundled model"
)
def test_the_demo_tells_the_story_in_order_and_exits_0(tmp_path: Path) -> None:
    env = {**os.environ, "KVGUARD_TORCH_THREADS": "1"}
    argv = [sys.executable, "-m", "kvguard", "demo", "--work-dir", str(tmp_path)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=420)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    # the steps, in the order
    heads = re.findall(r"^\[(\d)/6\] (.*)$", out, re.MULTILINE)
    assert [int(i) for i, _ in heads] == [1, 2, 3, 4, 5, 6], out
    titles = [title for _, title in heads]
    for title, expected in zip(titles[1:], STEPS, strict=True):
        assert title.startswith(expected), (title, expected)
    step = {int(i): out.index(f"[{i}/6]") for i, _ in heads}
    chats = out[step[2] : step[3]]
    assert re.search(r"tenant-a .* -> 200, own marker stripped", chats), chats
    assert re.search(r"tenant-b .* -> 200$", chats, re.MULTILINE), chats
    assert re.search(r"probe +canary echo probe on 'guarded' +-> pass", out[step[3] : step[4]])
    assert "-> 400 context_length_exceeded" in out[step[4] : step[5]]
    incident = out[step[5] : step[6]]
    assert "-> 200, stream cut: isolation_violation" in incident, incident
    assert re.search(r"finding   #\d+ cross_tenant / critical on engine", incident), incident
    assert "engine    'drill' quarantined" in incident
    # the summary table, then where to look in Grafana
    summary = out[step[6] :]
    assert "2 chats           guarded  200" in summary, summary
    assert "3 probe           guarded  echo pass" in summary
    assert "4 capacity check  guarded  -" in summary and "400 context_length_exceeded" in summary
    assert "5 incident        drill    200" in summary and "leak caught" in summary
    grafana = summary[summary.index("Where to look in Grafana") :]
    for pointer in grafana_pointers()[1:]:
        assert pointer in grafana
    for dashboard in ("Tenant traffic", "Isolation overview", "Capacity truth"):
        assert f"kvguard / {dashboard}" in grafana
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
    """The outcome the demo expects: chats served, probe passed, B refused on guarded, then B
    cut and found on drill."""
    finding = {
        "kind": "cross_tenant",
        "severity": "critical",
        "victim_tenant_id": "tenant-a-id",
        "victim_request_id": "a1",
    }
    story = Story(
        a_id="tenant-a-id",
        chats=Act("guarded", _exchange(200), _exchange(200)),
        probe=Probe(True, "200, own marker echoed, 0 other"),
        refusal=_exchange(400, drillstack.REFUSED_CODE),
        incident=Act("drill", _exchange(200, request_id="a1"), _exchange(200, drillstack.CUT_CODE)),
        finding=finding,
        quarantine="canary: isolation finding on request b1",
    )
    return replace(story, **changes)


def test_the_expected_outcome_holds() -> None:
    story = _story()
    assert (story.served(), story.refused(), story.leak_caught(), story.held()) == (True,) * 4


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
    assert (story.leak_caught(), story.refused(), story.held()) == (False, True, False)


@pytest.mark.parametrize(
    "changes",
    [
        {"refusal": _exchange(200)},
        {"refusal": _exchange(400, "invalid_request")},
        {"probe": Probe(False, "200, own marker missing, 0 other")},
    ],
    ids=["b-served", "other-refusal", "probe-failed"],
)
def test_defences_that_do_not_refuse_fail_the_story(changes: dict[str, Any]) -> None:
    story = _story(**changes)
    assert (story.leak_caught(), story.refused(), story.held()) == (True, False, False)


@pytest.mark.parametrize(
    "changes",
    [
        {"chats": Act("guarded", _exchange(200, marker=True), _exchange(200))},
        {"chats": Act("guarded", _exchange(200), _exchange(429, "rate_limit_exceeded"))},
    ],
    ids=["own-marker-delivered", "b-not-served"],
)
def test_tenants_not_served_normally_fail_the_story(changes: dict[str, Any]) -> None:
    story = _story(**changes)
    assert (story.served(), story.held()) == (False, False)


def test_the_grafana_pointers_name_real_panels() -> None:
    from dashboards.catalog import DASHBOARDS

    titles = {d.title for d in DASHBOARDS} | {p.title for d in DASHBOARDS for p in d.panels}
    named = " ".join(grafana_pointers())
    assert sum(title in named for title in titles) >= 10
