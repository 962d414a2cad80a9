"""``kvguard canary``: run the probes against a gateway, or make a new canary key (the findings
commands, ``findings``, ``finding``, ``probe-runs``, ``clear-quarantine``: ``canary.admin_cli``).

``kvguard canary probe --gateway URL --once`` runs every probe kind once, prints a table, reports
the results to the gateway and exits 0 only if every probe passed (CI and deploy gates); without
``--once`` it repeats every ``KVGUARD_CANARY_PROBE_INTERVAL_S`` until interrupted, touching the
``--heartbeat`` file at start and after every round (whatever its outcome), so a health check can
test that the loop is alive by the file's age. The canary key (``KVGUARD_CANARY_KEY``) and admin
token (``KVGUARD_ADMIN_TOKEN``) are the gateway's.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from pathlib import Path
from typing import Any

from canary import admin_cli

# Only light imports here: `kvguard --help` must not pay for httpx or pydantic-settings.

EXIT_OK, EXIT_FAILED, EXIT_SETUP = 0, 1, 2


def register(subparsers: Any) -> None:
    canary = subparsers.add_parser("canary", help="canary probes and keys")
    commands = canary.add_subparsers(dest="canary_command", required=True, metavar="ACTION")
    probe = commands.add_parser(
        "probe",
        help="run the canary probes against a gateway",
        description="Run synthetic canary tenants through a gateway: echo, capacity boundary, "
        "cross-tenant pair and abort drill. Exit status 0 only if all pass.",
    )
    probe.add_argument(
        "--gateway", default=None, help="gateway base URL (or KVGUARD_CANARY_GATEWAY_URL)"
    )
    probe.add_argument("--once", action="store_true", help="run once and exit (0 = all passed)")
    probe.add_argument(
        "--kind",
        action="append",
        default=None,
        choices=["echo", "capacity", "cross_tenant", "abort"],
        help="run only this probe kind (repeatable; default: all)",
    )
    probe.add_argument("--model", default=None, help="model to probe (default: the first served)")
    probe.add_argument(
        "--no-report", action="store_true", help="do not send results to the gateway"
    )
    probe.add_argument(
        "--heartbeat",
        type=Path,
        default=None,
        metavar="FILE",
        help="touch FILE at start and after every round (a liveness signal for health checks)",
    )
    probe.set_defaults(handler=run_probe)
    key = commands.add_parser("new-key", help="print a fresh random canary key")
    key.set_defaults(handler=run_new_key)
    admin_cli.register(commands)


def run_new_key(args: argparse.Namespace) -> int:
    from canary.config import new_key

    print(new_key())
    return EXIT_OK


def run_probe(args: argparse.Namespace) -> int:
    from canary.config import CanarySettings
    from contracts.settings import CONFIG_ERRORS, settings_error

    try:
        settings = CanarySettings()
    except CONFIG_ERRORS as exc:
        print(f"kvguard canary: invalid settings: {settings_error(exc)}", file=sys.stderr)
        return EXIT_SETUP
    url = args.gateway or settings.canary_gateway_url
    if not url:
        print(
            "kvguard canary: pass --gateway URL (or set KVGUARD_CANARY_GATEWAY_URL)",
            file=sys.stderr,
        )
        return EXIT_SETUP
    try:
        return asyncio.run(_probe_loop(args, settings, url.rstrip("/")))
    except KeyboardInterrupt:
        return EXIT_OK


async def _probe_loop(args: argparse.Namespace, settings: Any, url: str) -> int:
    """One client and one runner for the whole schedule: the probe keys are reused round after
    round and revoked when the loop ends (``--once``, an error, or Ctrl-C)."""
    import httpx

    from canary.findings import ProbeKind
    from canary.markers import MarkerCodec
    from canary.probes import GatewayClient, ProbeRunner

    kinds = [ProbeKind(k) for k in (args.kind or [k.value for k in ProbeKind])]
    async with httpx.AsyncClient(base_url=url, timeout=settings.canary_probe_timeout_s) as http:
        gateway = GatewayClient(http, admin_token=settings.admin_secret())
        runner = ProbeRunner(
            gateway,
            MarkerCodec(settings.keyring()),
            tenant_prefix=settings.canary_probe_tenant_prefix,
            model=args.model,
        )
        _beat(args.heartbeat)
        try:
            while True:
                status = await _probe_once(runner, kinds, report=not args.no_report)
                _beat(args.heartbeat)
                if args.once:
                    return status
                await asyncio.sleep(settings.canary_probe_interval_s)
        finally:
            await _close(runner)


def _beat(heartbeat: Path | None) -> None:
    """Touch the heartbeat file: the loop is alive (whatever the round's outcome)."""
    if heartbeat is not None:
        heartbeat.touch()


async def _probe_once(runner: Any, kinds: list[Any], *, report: bool) -> int:
    import httpx

    from canary.probes import ProbeSetupError, format_table

    try:
        results = await runner.run(kinds)
    except (ProbeSetupError, httpx.HTTPError) as exc:
        print(f"kvguard canary: probes could not run: {exc}", file=sys.stderr, flush=True)
        return EXIT_SETUP
    reported = True
    if report:  # before the table: a printed round is a stored one
        try:
            await runner.gateway.report(uuid.uuid4().hex, results)
        except (ProbeSetupError, httpx.HTTPError) as exc:
            print(f"kvguard canary: results not reported: {exc}", file=sys.stderr, flush=True)
            reported = False
    print(format_table(results), flush=True)
    return EXIT_OK if reported and all(r.passed for r in results) else EXIT_FAILED


async def _close(runner: Any) -> None:
    import httpx

    from canary.probes import ProbeSetupError

    try:
        await runner.close()
    except (ProbeSetupError, httpx.HTTPError) as exc:
        print(f"kvguard canary: probe keys not revoked: {exc}", file=sys.stderr, flush=True)
