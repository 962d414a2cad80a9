"""The operations walk-through's test alert (docs/operations.md, "From docker compose up to an
isolation alert", step 8), run as written: its ``amtool`` commands, minus the
``docker compose exec alertmanager`` prefix and with this test's address, go to a real
Alertmanager (Debian's ``prometheus-alertmanager``) running the committed deploy/alertmanager.yml
with a webhook filled in as step 2 says; the webhook (the user's receiver here) must get the
firing alert through the ``kvguard`` receiver, in a group of its own, and Alertmanager must list
it and resolve it by itself after its ``resolve_timeout``.
"""

from __future__ import annotations

import shlex
import subprocess
from datetime import datetime
from typing import Any

import httpx
import yaml
from ops_stack import REPO, completed_alertmanager_config, webhook_receiver

from dashboards.alerts import ALERTS
from kvguard.localservices import alertmanager_server

PREFIX = ["docker", "compose", "exec", "alertmanager", "amtool"]
URL_FLAG = "--alertmanager.url="
TEST_ENGINE = "walkthrough-test"


def _walkthrough_commands() -> list[list[str]]:
    """The step's shell commands, each as its argv (continuation lines joined)."""
    doc = (REPO / "docs" / "operations.md").read_text()
    step = doc[doc.index("8. Fire the isolation alert") : doc.index("9. Respond from the CLI")]
    start = step.index("```sh\n") + len("```sh\n")
    block = step[start : step.index("```", start)].replace("\\\n", " ")
    return [shlex.split(line) for line in block.splitlines() if line.strip()]


def _compose_alertmanager_url() -> str:
    """Where Alertmanager listens inside its compose container (its health check asks there)."""
    compose = yaml.safe_load((REPO / "compose.yaml").read_text())
    test = compose["services"]["alertmanager"]["healthcheck"]["test"]
    (ready,) = [arg for arg in test if arg.endswith("/-/ready")]
    return ready.removesuffix("/-/ready")


def _here(command: list[str], url: str) -> list[str]:
    """The documented command as run here: Debian's amtool, this test's Alertmanager."""
    assert command[: len(PREFIX)] == PREFIX, command
    argv = ["amtool", *command[len(PREFIX) :]]
    (flag,) = [a for a in argv if a.startswith(URL_FLAG)]
    assert flag == URL_FLAG + _compose_alertmanager_url(), flag
    return [URL_FLAG + url if a == flag else a for a in argv]


def _labels(argv: list[str]) -> dict[str, str]:
    pairs = [a for a in argv[3:] if "=" in a and not a.startswith("-")]
    return dict(pair.split("=", 1) for pair in pairs)


def _run(argv: list[str]) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _ours(body: dict[str, Any]) -> bool:
    return any(a["labels"].get("engine") == TEST_ENGINE for a in body["alerts"])


def test_the_walkthroughs_test_alert_reaches_the_users_receiver() -> None:
    add, query = _walkthrough_commands()
    assert add[len(PREFIX) : len(PREFIX) + 2] == ["alert", "add"]
    assert query[len(PREFIX) : len(PREFIX) + 2] == ["alert", "query"]
    with (
        webhook_receiver() as webhook,
        alertmanager_server(completed_alertmanager_config(webhook.url)) as alertmanager,
    ):
        add_here, query_here = (_here(c, alertmanager.url) for c in (add, query))
        labels = _labels(add_here)
        (rule,) = [r for r in ALERTS if r.name == labels["alertname"]]
        assert labels == {
            "alertname": "KvguardCrossTenantFinding",
            "severity": rule.severity,
            "kind": "cross_tenant",
            "engine": TEST_ENGINE,
        }
        _run(add_here)
        listed = _run(query_here)
        assert "KvguardCrossTenantFinding" in listed and "TEST from the kvguard" in listed, listed
        # the committed group_wait (10 s) passes before the group's first notification
        body = webhook.wait_for(_ours, timeout_s=40)
        stored = httpx.get(alertmanager.url + "/api/v2/alerts", timeout=10).json()
    assert body["receiver"] == "kvguard" and body["status"] == "firing", body
    assert body["groupLabels"] == {"alertname": labels["alertname"], "engine": TEST_ENGINE}
    (alert,) = body["alerts"]
    assert alert["labels"] == labels and alert["status"] == "firing"
    assert alert["annotations"]["summary"].startswith("TEST from the kvguard operations")
    (kept,) = stored
    lasts = datetime.fromisoformat(kept["endsAt"]) - datetime.fromisoformat(kept["startsAt"])
    assert 299 <= lasts.total_seconds() <= 301, kept  # resolve_timeout: resolved by itself in 5 min
