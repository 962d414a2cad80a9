"""``kvguard gateway``: the tenant-facing gateway with the canary's hooks, served by uvicorn.

The roof assembles the two deployables here: the gateway (``gateway.app``) knows the canary only
through the plug-in API (``contracts.plugins``), and the canary's hooks are built from its own
settings (``KVGUARD_CANARY_*``; the leak firewall is on unless ``KVGUARD_CANARY_ENABLED=0``).
Settings are read first, so a refusal is one line (exit 2) before the heavy imports.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def register(subparsers: Any) -> None:
    gateway = subparsers.add_parser(
        "gateway",
        help="run the tenant-facing gateway",
        description="Serve the OpenAI-compatible "
        "tenant API with keys, limits and capacity truth from the engines.",
    )
    gateway.add_argument(
        "--host", default=None, help="address to listen on (default: KVGUARD_HOST, else 127.0.0.1)"
    )
    gateway.add_argument(
        "--port", type=int, default=None, help="port (default: KVGUARD_PORT, else 8000)"
    )
    gateway.add_argument(
        "--engine",
        action="append",
        default=[],
        metavar="[KIND=]URL",
        help="an engine to route to (kind: bundled (default), sglang, vllm); repeatable",
    )
    gateway.add_argument("--log-level", default="info")
    gateway.set_defaults(handler=run_gateway)


def run_gateway(args: argparse.Namespace) -> int:
    from canary.config import CanarySettings
    from contracts.settings import (
        CONFIG_ERRORS,
        DefaultSecretError,
        require_distinct_secrets,
        settings_error,
    )
    from gateway.config import GatewaySettings
    from gateway.engines.spec import parse_engine_arg

    refused: tuple[type[Exception], ...] = (*CONFIG_ERRORS, DefaultSecretError)
    try:  # settings first: a refusal is one line, before the heavy imports below
        env = GatewaySettings()
        overrides: dict[str, Any] = {"engines": [*env.engines, *map(parse_engine_arg, args.engine)]}
        if args.host is not None:
            overrides["host"] = args.host
        if args.port is not None:
            overrides["port"] = args.port
        settings = GatewaySettings(**overrides)
        canary = CanarySettings()
        # One process holds both classes' secrets: no two roles may share one across them either
        # (the marker key must not be the engines' credential, which every engine holds).
        roles = {**settings.role_secrets(), **canary.role_secrets()}  # one admin token: one role
        require_distinct_secrets(settings.mode, **roles)
    except refused as exc:
        print(f"kvguard gateway: cannot start: {settings_error(exc)}", file=sys.stderr)
        return 2
    return _serve_gateway(settings, canary, log_level=args.log_level)


def _serve_gateway(settings: Any, canary: Any, *, log_level: str) -> int:
    from canary.runtime import build_hooks
    from contracts.http_edge import EdgeServer
    from gateway.app import create_app, server_config

    hooks = build_hooks(canary)  # the leak firewall: on unless KVGUARD_CANARY_ENABLED=0
    config = server_config(
        create_app(settings, hooks=hooks, settle=True),
        host=settings.host,
        port=settings.port,
        log_level=log_level,
    )
    EdgeServer(config).run()
    return 0
