"""The `kvguard` command as a new user meets it: a bad setting is one line and exit 2 (never a
traceback), `kvguard admin` says which database it uses (and when it creates one: only `migrate`
and `tenant create` do; every other command where there is none exits 1 and says where it looked),
and `--help` lists every subcommand and every default."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvguard.cli import build_parser

ENV_KEEP = ("PATH", "HOME", "LANG", "PYTHONPATH")


def kvguard(cwd: Path, *argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``kvguard ARGV`` as a process in ``cwd``, with only ``env`` as its KVGUARD_* settings."""
    clean = {k: v for k, v in os.environ.items() if k in ENV_KEEP}
    return subprocess.run(
        [sys.executable, "-m", "kvguard", *argv],
        cwd=cwd,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    ("argv", "setting", "says"),
    [
        (("gateway",), {"KVGUARD_ENGINES": "not json"}, "KVGUARD_ENGINES is not valid JSON"),
        (("gateway",), {"KVGUARD_DATABASE_URL": "junk"}, "KVGUARD_DATABASE_URL is not a"),
        (("gateway",), {"KVGUARD_ENGINES_FILE": "missing.toml"}, "engines file missing.toml"),
        (("admin", "tenant", "list"), {"KVGUARD_ENGINES": "[1"}, "KVGUARD_ENGINES"),
        (("up",), {"KVGUARD_CANARY_KEY": "short"}, "at least 32 bytes"),
    ],
)
def test_a_bad_setting_is_one_line_and_exit_2(
    tmp_path: Path, argv: tuple[str, ...], setting: dict[str, str], says: str
) -> None:
    done = kvguard(tmp_path, *argv, **setting)
    assert (done.returncode, done.stderr.count("\n")) == (2, 1), done.stderr[-2000:]
    assert says in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "data").exists()  # refused before anything was created


def test_admin_says_which_database_it_uses_and_when_it_creates_one(tmp_path: Path) -> None:
    database = tmp_path / "data" / "kvguard.db"
    first = kvguard(tmp_path, "admin", "migrate")
    assert first.returncode == 0, first.stderr
    assert f"creating a new database at {database}" in first.stderr
    assert "KVGUARD_DATA_DIR" in first.stderr and database.exists()
    again = kvguard(tmp_path, "admin", "tenant", "list")
    assert again.returncode == 0 and again.stdout == ""
    assert f"database sqlite:///{database}" in again.stderr and "creating" not in again.stderr
    assert "no tenants in this database" in again.stderr


# Every admin command but the two that set a database up: run where there is none, each reads or
# changes what is not there, so a new empty database would only hide that it looked elsewhere.
NEEDS_A_DATABASE = [
    ("tenant", "list"),
    ("tenant", "enable", "acme"),
    ("tenant", "disable", "acme"),
    ("tenant", "set-limits", "acme", "--rpm", "5"),
    ("tenant", "erase-responses", "acme"),
    ("key", "create", "acme"),
    ("key", "list", "acme"),
    ("key", "revoke", "abcdef"),
]


@pytest.mark.parametrize("argv", NEEDS_A_DATABASE, ids=" ".join)
def test_admin_where_there_is_no_database_creates_none_and_says_where_it_looked(
    tmp_path: Path, argv: tuple[str, ...]
) -> None:
    done = kvguard(tmp_path, "admin", *argv)
    assert (done.returncode, done.stdout, done.stderr.count("\n")) == (1, "", 1), done.stderr
    database = tmp_path / "data" / "kvguard.db"
    assert done.stderr.startswith(f"kvguard admin: no database at {database}; ")
    assert "KVGUARD_DATA_DIR or KVGUARD_DATABASE_URL" in done.stderr
    assert "kvguard admin migrate" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "data").exists()


def test_admin_tenant_create_sets_up_a_fresh_install(tmp_path: Path) -> None:
    """The documented first step (then ``kvguard gateway`` in the same place) creates the
    database, and says so; a second command finds it."""
    database = tmp_path / "data" / "kvguard.db"
    created = kvguard(tmp_path, "admin", "tenant", "create", "acme")
    assert created.returncode == 0, created.stderr
    assert f"creating a new database at {database}" in created.stderr
    assert created.stdout.splitlines()[-1].startswith("kvg_")
    listed = kvguard(tmp_path, "admin", "key", "list", "acme")
    assert listed.returncode == 0 and f"database sqlite:///{database}" in listed.stderr
    assert len(listed.stdout.splitlines()) == 1


def parsers(parser: argparse.ArgumentParser, path: str = "kvguard"):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, f"{path} {name}")


def test_every_subcommand_is_listed_with_what_it_does() -> None:
    unlisted = []
    for path, parser in parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                described = {choice.dest for choice in action._choices_actions if choice.help}
                unlisted += [f"{path} {name}" for name in action.choices if name not in described]
    assert unlisted == []
    tenant_help = dict(parsers(build_parser()))["kvguard admin tenant"].format_help()
    for action in ("create", "list", "disable", "enable", "set-limits", "erase-responses"):
        assert f"    {action}" in tenant_help
    key_help = dict(parsers(build_parser()))["kvguard admin key"].format_help()
    for action in ("create", "list", "revoke"):
        assert f"    {action}" in key_help


def test_every_option_shows_its_default() -> None:
    silent = []
    for path, parser in parsers(build_parser()):
        for action in parser._actions:
            default = action.default
            if not action.option_strings or default in (None, False, [], argparse.SUPPRESS):
                continue
            if "default" not in (action.help or ""):
                silent.append(f"{path} {action.option_strings[0]}")
    assert silent == []
    gateway = dict(parsers(build_parser()))["kvguard gateway"].format_help()
    assert "(default: KVGUARD_PORT, else 8000)" in gateway and "default: info" in gateway
