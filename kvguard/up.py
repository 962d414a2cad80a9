"""`kvguard up`: the embedded stack on one machine, as supervised child processes.

Profiles:
- ``embedded`` (default): the bundled backend (unified role, bundled model, CPU) on 127.0.0.1.
  Each later part (gateway with SQLite, canary probes) joins this list as it lands.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from kvguard.supervisor import RoleSpec, Supervisor

PROFILES = ("embedded",)


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "up",
        help="run the embedded stack (supervised local processes)",
        description="Start every role of the chosen profile, wait for health, stop all on Ctrl-C.",
    )
    parser.add_argument("--profile", choices=PROFILES, default="embedded")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--backend-port", type=int, default=8100)
    parser.set_defaults(handler=run)


def embedded_roles(host: str, backend_port: int) -> list[RoleSpec]:
    kvguard = [sys.executable, "-m", "kvguard"]
    backend = RoleSpec(
        name="backend (unified)",
        argv=[*kvguard, "backend", "unified", "--host", host, "--port", str(backend_port)],
        url=f"http://{host}:{backend_port}",
    )
    return [backend]


def banner(roles: list[RoleSpec]) -> str:
    backend = roles[0].url
    return "\n".join(
        [
            "Try it:",
            f"  curl -s {backend}/v1/chat/completions -H 'Content-Type: application/json' \\",
            '    -d \'{"model": "kvguard-tiny", "max_tokens": 48, "temperature": 0,'
            ' "messages": [{"role": "user", "content": "Repeat exactly: hello kvguard"}]}\'',
            f"  curl -s {backend}/engine/capacity",
        ]
    )


def run(args: argparse.Namespace) -> int:
    roles = embedded_roles(args.host, args.backend_port)
    return Supervisor(roles).run(banner(roles))
