"""`kvguard up`: the embedded stack on one machine, as supervised child processes.

Profiles:
- ``embedded`` (default): the bundled backend (unified role, bundled model, CPU) and the gateway
  (SQLite under ``--data-dir``, in-process limits) on 127.0.0.1. Once both are healthy a demo
  tenant key is issued through ``kvguard admin`` (the same settings the gateway reads), and the
  banner shows a ``curl`` that works with it.
- ``production-like``: the compose topology (compose.yaml) without Docker, on 127.0.0.1: private
  PostgreSQL, Redis and Prometheus (kvguard.localservices, temp dirs, discarded at exit); migrations
  run once; the backend as separate prefill and decode roles; ``--gateway-replicas`` gateways
  sharing PostgreSQL and Redis; the canary probe runner against the first replica;
  ``KVGUARD_MODE=production`` with a fresh admin token, metrics token and canary key printed in the
  banner. Prometheus scrapes every role (the gateways with the metrics token) and loads the
  committed alert rules.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvguard.supervisor import RoleSpec, Supervisor

PROFILES = ("embedded", "production-like")
DEMO_TENANT = "demo"


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "up",
        help="run the embedded stack (supervised local processes)",
        description="Start every role of the chosen profile, wait for health, stop all on Ctrl-C.",
    )
    parser.add_argument("--profile", choices=PROFILES, default="embedded")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="the gateway's port")
    parser.add_argument("--backend-port", type=int, default=8100)
    parser.add_argument("--data-dir", type=Path, default=Path("data"), help="SQLite and state")
    parser.add_argument(
        "--prefill-port", type=int, default=8101, help="production-like: the prefill role's port"
    )
    parser.add_argument(
        "--gateway-replicas",
        type=int,
        default=2,
        help="production-like: gateways on --port, --port+1, ... sharing PostgreSQL and Redis",
    )
    parser.set_defaults(handler=run)


def stack_env(data_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("KVGUARD_DATA_DIR", str(data_dir))
    env.setdefault("KVGUARD_MODE", "development")
    # The engine takes calls only from this run's gateway (backend.server.auth).
    env.setdefault("KVGUARD_ENGINE_TOKEN", secrets.token_urlsafe(32))
    return env


def settings_refusal(env: dict[str, str]) -> str | None:
    """Every role's settings, read from the stack's environment before anything starts: one
    line naming what is wrong, or None (a role refusing later would stop the others half-up)."""
    from backend.config import BackendSettings
    from canary.config import CanarySettings
    from contracts.settings import CONFIG_ERRORS, settings_error
    from gateway.config import GatewaySettings

    os.environ.update(env)  # the roles' environment, which this process hands them anyway
    for settings in (BackendSettings, GatewaySettings, CanarySettings):
        try:
            settings()
        except CONFIG_ERRORS as exc:
            return settings_error(exc)
    return None


def embedded_roles(args: argparse.Namespace, env: dict[str, str]) -> list[RoleSpec]:
    kvguard = [sys.executable, "-m", "kvguard"]
    host, backend_port, gateway_port = args.host, args.backend_port, args.port
    backend_url = f"http://{host}:{backend_port}"
    backend = RoleSpec(
        name="backend (unified)",
        argv=[*kvguard, "backend", "unified", "--host", host, "--port", str(backend_port)],
        url=backend_url,
        env=env,
    )
    gateway = RoleSpec(
        name="gateway",
        argv=[*kvguard, "gateway", "--host", host, "--port", str(gateway_port)]
        + ["--engine", backend_url],
        url=f"http://{host}:{gateway_port}",
        env=env,
    )
    return [backend, gateway]


def issue_demo_key(env: dict[str, str]) -> str:
    """A fresh key for the demo tenant (creating the tenant on the first run)."""
    kvguard = [sys.executable, "-m", "kvguard", "admin"]
    created = subprocess.run(
        [*kvguard, "tenant", "create", DEMO_TENANT], env=env, capture_output=True, text=True
    )
    if created.returncode != 0:
        created = subprocess.run(
            [*kvguard, "key", "create", DEMO_TENANT], env=env, capture_output=True, text=True
        )
    if created.returncode != 0:
        raise RuntimeError(f"could not issue a demo key: {created.stderr.strip()}")
    return created.stdout.strip().splitlines()[-1]


def banner(gateway_url: str, backend_url: str, key: str, engine_token: str) -> str:
    return "\n".join(
        [
            f"Demo tenant '{DEMO_TENANT}', API key (shown once): {key}",
            "",
            "Try it:",
            f"  curl -s {gateway_url}/v1/chat/completions \\",
            f"    -H 'Authorization: Bearer {key}' -H 'Content-Type: application/json' \\",
            '    -d \'{"model": "kvguard-tiny", "max_tokens": 48, "temperature": 0,',
            '         "messages": [{"role": "user",',
            '                       "content": "Repeat exactly: hello kvguard"}]}\'',
            f"  curl -s -H 'Authorization: Bearer {engine_token}' \\",
            f"    {backend_url}/engine/capacity    # the capacity truth the gateway enforces",
            "  (the engine's credential, this run only: only the gateway may call the engine)",
        ]
    )


def run(args: argparse.Namespace) -> int:
    if args.profile == "production-like":
        from kvguard.up_production import run_production_like

        return run_production_like(args)
    env = stack_env(args.data_dir.resolve())  # absolute: `kvguard admin` can be pointed at it
    refusal = settings_refusal(env)
    if refusal is not None:
        print(f"kvguard up: cannot start: {refusal}", file=sys.stderr)
        return 2
    roles = embedded_roles(args, env)
    backend, gateway = roles

    def after_start() -> str:
        return banner(gateway.url, backend.url, issue_demo_key(env), env["KVGUARD_ENGINE_TOKEN"])

    return Supervisor(roles).run(after_start)
