"""`kvguard backend unified|prefill|decode`: the engine's server roles."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

_OVERRIDES = (
    "host",
    "port",
    "model",
    "served_model_name",
    "dtype",
    "pool_tokens",
    "page_size",
    "context_window",
)


def register(subparsers: Any) -> None:
    backend = subparsers.add_parser("backend", help="run the bundled paged-KV engine")
    roles = backend.add_subparsers(dest="role", required=True, metavar="ROLE")
    unified = roles.add_parser(
        "unified",
        help="one process serving prefill and decode",
        description="Serve the OpenAI-compatible API and /engine/capacity from one process.",
    )
    _add_engine_options(unified)
    unified.set_defaults(handler=run_unified)
    prefill = roles.add_parser(
        "prefill",
        help="the prefill role: computes prompt KV and writes it into decode's pages",
        description="Serve the handoff endpoints (/kv/v1/*) and /engine/capacity.",
    )
    _add_engine_options(prefill)
    prefill.set_defaults(handler=run_role, role_name="prefill")
    decode = roles.add_parser(
        "decode",
        help="the decode role: the entry point, with the unified role's HTTP contract",
        description="Serve the OpenAI-compatible API; prompts are prefilled by --prefill-url.",
    )
    _add_engine_options(decode)
    decode.add_argument("--prefill-url", required=True, help="base URL of the prefill role")
    decode.set_defaults(handler=run_role, role_name="decode")


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="port to listen on (default 8100)")
    parser.add_argument(
        "--model",
        type=Path,
        help="checkpoint dir, or a Hugging Face cache entry models--org--name[/snapshots/HASH] "
        "(default: the bundled model)",
    )
    parser.add_argument(
        "--served-model-name",
        help="model id clients send and /v1/models lists (default: org/name for a cache "
        "entry, else the checkpoint dir's name)",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="compute and KV dtype (default auto: float32 on CPU, the checkpoint's on GPU)",
    )
    parser.add_argument("--pool-tokens", type=int, help="KV pool size in tokens")
    parser.add_argument("--page-size", type=int, help="tokens per KV page (default 16)")
    parser.add_argument("--context-window", type=int, help="advertised context window")
    parser.add_argument(
        "--allow-capacity-drift",
        action="store_true",
        default=None,
        help="start even if the window exceeds the real pool (reported as drift)",
    )
    parser.add_argument(
        "--allow-fault-drills",
        action="store_true",
        default=None,
        help="permit --fault (drills reproduce old failure modes; never in production)",
    )
    parser.add_argument(
        "--fault",
        action="append",
        dest="faults",
        metavar="NAME",
        help="enable a fault drill (repeatable); needs --allow-fault-drills",
    )


def settings_from_args(args: argparse.Namespace) -> Any:
    from backend.config import BackendSettings

    overrides = {k: getattr(args, k) for k in _OVERRIDES if getattr(args, k) is not None}
    for flag in ("allow_capacity_drift", "allow_fault_drills"):
        if getattr(args, flag, None):
            overrides[flag] = True
    if getattr(args, "faults", None):
        overrides["faults"] = list(args.faults)
    if getattr(args, "prefill_url", None):
        overrides["prefill_url"] = args.prefill_url
    return BackendSettings(**overrides)


def run_unified(args: argparse.Namespace) -> int:
    return _serve(args, "unified")


def run_role(args: argparse.Namespace) -> int:
    return _serve(args, args.role_name)


def _serve(args: argparse.Namespace, role_name: str) -> int:
    from backend.engine.build import CapacityDriftRefused
    from backend.model.errors import CheckpointError
    from backend.server.app import create_app
    from backend.transport.base import TransportUnavailable
    from contracts.engine import Role
    from contracts.http_edge import EdgeServer, server_config
    from contracts.settings import CONFIG_ERRORS, settings_error

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per handoff call otherwise
    refusals: tuple[type[Exception], ...] = (
        *CONFIG_ERRORS,
        CheckpointError,
        CapacityDriftRefused,
        TransportUnavailable,
        ValueError,
    )
    try:
        settings = settings_from_args(args)
        app = create_app(settings, Role(role_name))
    except refusals as exc:
        reason = settings_error(exc)
        print(f"kvguard backend {role_name}: cannot start: {reason}", file=sys.stderr)
        return 2
    config = server_config(
        app, host=settings.host, port=settings.port, header_timeout_s=settings.header_timeout_s
    )
    EdgeServer(config).run()
    return 0
