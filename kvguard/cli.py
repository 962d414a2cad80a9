"""The `kvguard` command: one entry point, one subcommand per role or tool.

Each part registers its own subcommands (``register(subparsers)``) so that this module stays a
thin index and importing it costs nothing: the heavy imports (torch, FastAPI, litellm) happen
inside the chosen subcommand's handler.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from canary import cli as canary_cli
from gateway import cli as gateway_cli
from kvguard import benchcmd, demo, gateway_command, up
from kvguard.load import cli as load_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvguard",
        description="Multi-tenant LLM serving that refuses instead of leaking.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    up.register(subparsers)
    demo.register(subparsers)
    gateway_command.register(subparsers)
    gateway_cli.register(subparsers)
    canary_cli.register(subparsers)
    from backend import cli as backend_cli

    backend_cli.register(subparsers)
    load_cli.register(subparsers)
    benchcmd.register(subparsers)
    show_defaults(parser)
    return parser


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option of every command says its default in ``--help`` (when it has one worth
    saying: not None, not off, not empty)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                show_defaults(sub)
            continue
        default = action.default
        if not action.option_strings or default in (None, False, [], argparse.SUPPRESS):
            continue
        if action.help == argparse.SUPPRESS or "%(default)" in (action.help or ""):
            continue
        action.help = (
            f"{action.help} (default: %(default)s)" if action.help else "default: %(default)s"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    status = args.handler(args)
    return int(status or 0)


if __name__ == "__main__":
    sys.exit(main())
