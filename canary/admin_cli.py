"""``kvguard canary findings|finding|probe-runs|clear-quarantine``: the findings loop on the CLI.

An operator answering a ``KvguardCrossTenantFinding`` or ``KvguardEngineQuarantined`` alert:
1. ``findings`` lists what the firewall and the probes found (newest first; filters as the API's);
2. ``finding ID`` shows one in full (who was exposed, who received it, on which engine, evidence);
3. ``probe-runs`` lists the canary probes' results (expected vs observed per kind and engine);
4. ``clear-quarantine ENGINE`` puts the engine back into routing once it is fixed.

Each command calls the gateway's admin API (``--gateway`` or ``KVGUARD_CANARY_GATEWAY_URL``,
``KVGUARD_ADMIN_TOKEN``); ``--json`` prints the API's JSON instead of a table. Exit status: 0 done,
1 the gateway refused (no such finding or engine), 2 the command could not ask (no URL, gateway
unreachable, admin token refused).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

EXIT_OK, EXIT_REFUSED, EXIT_SETUP = 0, 1, 2

FINDING_COLUMNS = ("id", "detected_at", "kind", "severity", "engine", "action", "victim_tenant_id")
PROBE_COLUMNS = ("id", "started_at", "kind", "engine", "passed", "expected", "observed")


class CommandFailed(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def register(commands: Any) -> None:
    """Add the commands to ``kvguard canary``'s subparsers."""
    findings = _command(commands, "findings", "list canary findings (newest first)")
    # Kinds and severities are the API's to check (canary.findings defines them; importing it
    # here would load SQLAlchemy for `kvguard --help`).
    findings.add_argument("--kind", default=None, help="cross_tenant, cross_request, ...")
    findings.add_argument("--severity", default=None, help="critical, high or low")
    findings.add_argument("--tenant", default=None, help="only findings about this tenant's data")
    _window(findings)
    findings.set_defaults(handler=run_findings)
    one = _command(commands, "finding", "show one finding in full")
    one.add_argument("id", type=int)
    one.set_defaults(handler=run_finding)
    runs = _command(commands, "probe-runs", "list canary probe results (newest first)")
    runs.add_argument("--kind", default=None, help="echo, capacity, cross_tenant or abort")
    runs.add_argument("--run-id", default=None, help="one round of `kvguard canary probe`")
    _window(runs)
    runs.set_defaults(handler=run_probe_runs)
    clear = _command(commands, "clear-quarantine", "route to a quarantined engine again")
    clear.add_argument("engine", help="the engine's name (as in KVGUARD_ENGINES)")
    clear.set_defaults(handler=run_clear_quarantine)


def _command(commands: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = commands.add_parser(
        name, help=help_text, description=help_text
    )
    parser.add_argument(
        "--gateway", default=None, help="gateway base URL (or KVGUARD_CANARY_GATEWAY_URL)"
    )
    parser.add_argument("--json", action="store_true", help="print the API's JSON")
    return parser


def _window(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--since", default=None, help="ISO 8601 time, e.g. 2026-09-01T00:00:00Z")
    parser.add_argument("--limit", type=int, default=50, help="at most this many (1-1000)")


# -- the commands ---------------------------------------------------------------------------------


def run_findings(args: argparse.Namespace) -> int:
    params = {"kind": args.kind, "severity": args.severity, "tenant": args.tenant}
    return _run(args, "GET", "/admin/canary/findings", _listing(args, params), FINDING_COLUMNS)


def run_finding(args: argparse.Namespace) -> int:
    return _run(args, "GET", f"/admin/canary/findings/{args.id}", {}, None)


def run_probe_runs(args: argparse.Namespace) -> int:
    params = _listing(args, {"kind": args.kind, "run_id": args.run_id})
    return _run(args, "GET", "/admin/canary/probe-runs", params, PROBE_COLUMNS)


def run_clear_quarantine(args: argparse.Namespace) -> int:
    path = f"/admin/engines/{args.engine}/quarantine"
    status = _run(args, "DELETE", path, {}, ("name", "routable", "blocked_reason"))
    if status == EXIT_OK and not args.json:
        print(f"{args.engine}: quarantine cleared", flush=True)
    return status


def _listing(args: argparse.Namespace, params: dict[str, Any]) -> dict[str, Any]:
    return {**params, "since": args.since, "limit": args.limit}


def _run(
    args: argparse.Namespace,
    method: str,
    path: str,
    params: dict[str, Any],
    columns: Sequence[str] | None,
) -> int:
    try:
        body = _call(args.gateway, method, path, {k: v for k, v in params.items() if v is not None})
    except CommandFailed as exc:
        print(f"kvguard canary: {exc}", file=sys.stderr, flush=True)
        return exc.status
    if args.json:
        print(json.dumps(body, indent=2), flush=True)
    elif columns is None:
        print(_details(body), flush=True)
    else:
        rows = body if isinstance(body, list) else [body]
        print(_table(rows, columns), flush=True)
    return EXIT_OK


def _call(gateway: str | None, method: str, path: str, params: dict[str, Any]) -> Any:
    """The admin API's JSON answer; CommandFailed with the exit status and a one-line reason."""
    import httpx

    from canary.config import CanarySettings
    from contracts.settings import CONFIG_ERRORS, settings_error

    try:
        settings = CanarySettings()
    except CONFIG_ERRORS as exc:
        raise CommandFailed(EXIT_SETUP, f"invalid settings: {settings_error(exc)}") from exc
    url = gateway or settings.canary_gateway_url
    if not url:
        raise CommandFailed(EXIT_SETUP, "pass --gateway URL (or set KVGUARD_CANARY_GATEWAY_URL)")
    headers = {"Authorization": f"Bearer {settings.admin_secret()}"}
    try:
        with httpx.Client(base_url=url.rstrip("/"), timeout=30, headers=headers) as client:
            response = client.request(method, path, params=params)
    except httpx.HTTPError as exc:
        raise CommandFailed(EXIT_SETUP, f"cannot reach the gateway at {url}: {exc}") from exc
    if response.is_success:
        return response.json()
    status = EXIT_SETUP if response.status_code in (401, 403) else EXIT_REFUSED
    raise CommandFailed(status, f"{response.status_code}: {_error_message(response)}")


def _error_message(response: Any) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return str(response.text[:200])


# -- output ---------------------------------------------------------------------------------------


def _cell(value: Any, width: int = 48) -> str:
    text = "-" if value is None else str(value)
    return text if len(text) <= width else text[: width - 1] + "…"


def _table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    if not rows:
        return "(none)"
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def _details(body: dict[str, Any]) -> str:
    width = max(len(k) for k in body)
    return "\n".join(f"{k.ljust(width)}  {_cell(v, 400)}" for k, v in body.items())
