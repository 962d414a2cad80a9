"""``kvguard admin``: tenants, keys, limits, stored responses, migrations.

It reads the same ``KVGUARD_*`` settings as ``kvguard gateway`` (``kvguard.gateway_command``), so a
tenant created with ``kvguard admin`` can call a gateway started in the same environment.
``kvguard admin tenant create NAME`` prints the new tenant's first key on its last line (and
nowhere else: it is not stored).

Every command says on stderr which database it uses. Only ``migrate`` and ``tenant create`` (the
first step of a fresh install: the gateway then finds the tenant in the same place) create a
SQLite database that is not there yet, and say so; every other command, run where there is none
(another directory's ``./data`` is another database), creates nothing and exits 1 naming the path
it looked at and how to point it at the stack's.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from gateway.domain import TenantPlan
from gateway.lifecycle import TenantStatus

# Only pure modules at import time: `kvguard --help` must not pay for SQLAlchemy or FastAPI.


def _limit(text: str) -> int | None:
    if text.lower() in ("none", "unlimited"):
        return None
    from gateway.db.models import INTEGER_MAX

    value = int(text)
    if not 0 < value <= INTEGER_MAX:
        raise argparse.ArgumentTypeError(f"a limit is an integer in 1..{INTEGER_MAX} or 'none'")
    return value


def register(subparsers: Any) -> None:
    admin = subparsers.add_parser("admin", help="manage tenants, keys and the database")
    groups = admin.add_subparsers(dest="admin_command", required=True, metavar="AREA")
    groups.add_parser(
        "migrate", help="create the database, or upgrade it to the latest schema"
    ).set_defaults(handler=run_admin(_migrate, creates=True))
    tenant = groups.add_parser(
        "tenant", help="create/list/disable tenants, set limits, erase stored responses"
    )
    tenant_cmds = tenant.add_subparsers(dest="tenant_command", required=True, metavar="ACTION")
    create = tenant_cmds.add_parser("create", help="create a tenant; prints its first key last")
    create.add_argument("name")
    _limit_args(create)
    create.add_argument("--synthetic", action="store_true", help="a canary probe tenant")
    create.add_argument("--canary-sample-rate", type=float, default=0.0)
    create.add_argument("--key-expires-in", type=int, default=None, metavar="SECONDS")
    create.set_defaults(handler=run_admin(_tenant_create, creates=True))
    tenant_cmds.add_parser(
        "list", help="every tenant with its limits, one JSON line each"
    ).set_defaults(handler=run_admin(_tenant_list))
    for action, status in (("disable", TenantStatus.DISABLED), ("enable", TenantStatus.ACTIVE)):
        what = "refuse every key of a tenant (401)" if action == "disable" else "accept them again"
        cmd = tenant_cmds.add_parser(action, help=what)
        cmd.add_argument("name")
        cmd.set_defaults(handler=run_admin(_tenant_status), status=status)
    limits = tenant_cmds.add_parser("set-limits", help="change limits ('none' removes one)")
    limits.add_argument("name")
    _limit_args(limits)
    limits.set_defaults(handler=run_admin(_tenant_limits))
    erase = tenant_cmds.add_parser(
        "erase-responses", help="delete every stored response of a tenant now (it stays)"
    )
    erase.add_argument("name")
    erase.set_defaults(handler=run_admin(_tenant_erase_responses))
    key = groups.add_parser("key", help="create/list/revoke API keys")
    key_cmds = key.add_subparsers(dest="key_command", required=True, metavar="ACTION")
    key_create = key_cmds.add_parser("create", help="issue a key; prints it on the last line")
    key_create.add_argument("tenant")
    key_create.add_argument("--name", default=None)
    key_create.add_argument("--expires-in", type=int, default=None, metavar="SECONDS")
    key_create.set_defaults(handler=run_admin(_key_create))
    key_list = key_cmds.add_parser("list", help="a tenant's keys: prefix, name, dates (no secret)")
    key_list.add_argument("tenant")
    key_list.set_defaults(handler=run_admin(_key_list))
    revoke = key_cmds.add_parser("revoke", help="revoke a key by its prefix (kvg_<prefix>_...)")
    revoke.add_argument("prefix")
    revoke.set_defaults(handler=run_admin(_key_revoke))


def _limit_args(parser: argparse.ArgumentParser) -> None:
    for flag, dest in (
        ("--rpm", "requests_per_minute"),
        ("--tpm", "tokens_per_minute"),
        ("--concurrency", "max_concurrency"),
        ("--max-context", "max_context_tokens"),
    ):
        parser.add_argument(flag, dest=dest, type=_limit, default=argparse.SUPPRESS)


AdminAction = Callable[[argparse.Namespace, Any], None]


def run_admin(action: AdminAction, *, creates: bool = False) -> Callable[[argparse.Namespace], int]:
    """Wrap an admin action: settings, the database (created only when ``creates``), schema
    upgrade, one transaction, errors as messages."""

    def handler(args: argparse.Namespace) -> int:
        from sqlalchemy.exc import OperationalError

        from contracts.settings import CONFIG_ERRORS, settings_error
        from contracts.sql import make_session_factory, session_scope
        from gateway.config import GatewaySettings
        from gateway.db.session import make_engine, upgrade_database
        from gateway.errors import GatewayError

        try:
            settings = GatewaySettings()
        except CONFIG_ERRORS as exc:
            print(f"kvguard admin: invalid settings: {settings_error(exc)}", file=sys.stderr)
            return 2
        url = settings.sqlalchemy_url()
        missing = _missing_sqlite_file(url)
        if missing is not None and not creates:
            print(f"kvguard admin: {_no_database(missing)}", file=sys.stderr)
            return 1
        print(f"kvguard admin: {_which_database(url, missing)}", file=sys.stderr)
        engine = make_engine(url)
        try:
            if settings.migrate_on_start or action is _migrate:
                upgrade_database(engine)
            with session_scope(make_session_factory(engine)) as session:
                action(args, session)
        except GatewayError as exc:
            print(f"kvguard admin: {exc.message}", file=sys.stderr)
            return 1
        except OperationalError as exc:
            print(f"kvguard admin: the database did not answer ({exc.orig})", file=sys.stderr)
            return 1
        finally:
            engine.dispose()
        return 0

    return handler


_POINT_AT_THE_STACK = "KVGUARD_DATA_DIR or KVGUARD_DATABASE_URL as the stack was started with"


def _missing_sqlite_file(url: str) -> Path | None:
    """The SQLite file ``url`` names, when it is not there yet (None: it is, or the database is
    a server or in memory)."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    path = parsed.database or ":memory:"
    if parsed.get_backend_name() != "sqlite" or path == ":memory:":
        return None
    file = Path(path).resolve()
    return None if file.exists() else file


def _no_database(path: Path) -> str:
    return (
        f"no database at {path}; to use a running stack's, set {_POINT_AT_THE_STACK} "
        "('kvguard admin migrate' creates one here)"
    )


def _which_database(url: str, missing: Path | None) -> str:
    """The database this command uses, said on every run: another directory's ``./data`` is
    another database (the stack's is under the KVGUARD_DATA_DIR it was started with)."""
    from sqlalchemy.engine import make_url

    if missing is not None:
        return (
            f"creating a new database at {missing} (none was there; to use a running stack's, "
            f"set {_POINT_AT_THE_STACK})"
        )
    return f"database {make_url(url).render_as_string(hide_password=True)}"


def _migrate(args: argparse.Namespace, session: Any) -> None:
    print("database schema is at the latest revision")


def _tenant_create(args: argparse.Namespace, session: Any) -> None:
    from contracts.sql import utcnow
    from gateway.services.tenants import create_tenant

    plan = TenantPlan(**{k: getattr(args, k, None) for k in TenantPlan.__slots__})
    expires = (
        None if args.key_expires_in is None else utcnow() + timedelta(seconds=args.key_expires_in)
    )
    created = create_tenant(
        session,
        name=args.name,
        plan=plan,
        synthetic=args.synthetic,
        canary_sample_rate=args.canary_sample_rate,
        key_expires_at=expires,
    )
    print(f"tenant {created.tenant.name} created with id {created.tenant.id}")
    print(f"key prefix {created.first_key.prefix}; the key is shown once, below:")
    print(created.first_key.key)


def _tenant_row(tenant: Any) -> dict[str, Any]:
    from gateway.api.schemas_admin import TenantOut

    return TenantOut.of(tenant).model_dump(mode="json")


def _tenant_list(args: argparse.Namespace, session: Any) -> None:
    from gateway.services.tenants import list_tenants

    tenants = list_tenants(session)
    for tenant in tenants:
        print(json.dumps(_tenant_row(tenant)))
    if not tenants:
        print("kvguard admin: no tenants in this database", file=sys.stderr)


def _tenant_status(args: argparse.Namespace, session: Any) -> None:
    from gateway.services.tenants import get_tenant, set_status

    tenant = set_status(session, tenant=get_tenant(session, ref=args.name), status=args.status)
    print(f"tenant {tenant.name} is {tenant.status}")


def _tenant_limits(args: argparse.Namespace, session: Any) -> None:
    from gateway.services.tenants import get_tenant, plan_of, set_plan

    tenant = get_tenant(session, ref=args.name)
    current = plan_of(tenant)
    merged = {name: getattr(args, name, getattr(current, name)) for name in TenantPlan.__slots__}
    set_plan(session, tenant=tenant, plan=TenantPlan(**merged))
    print(json.dumps(_tenant_row(tenant)))


def _tenant_erase_responses(args: argparse.Namespace, session: Any) -> None:
    from gateway.services.responses import forget_tenant
    from gateway.services.tenants import get_tenant

    tenant = get_tenant(session, ref=args.name)
    erased = forget_tenant(session, tenant_id=tenant.id)
    print(f"erased {erased} stored responses of tenant {tenant.name}")


def _key_create(args: argparse.Namespace, session: Any) -> None:
    from contracts.sql import utcnow
    from gateway.services.keys import issue_key
    from gateway.services.tenants import get_tenant

    tenant = get_tenant(session, ref=args.tenant)
    expires = None if args.expires_in is None else utcnow() + timedelta(seconds=args.expires_in)
    issued = issue_key(session, tenant_id=tenant.id, name=args.name, expires_at=expires)
    print(f"key prefix {issued.prefix} for tenant {tenant.name}; shown once, below:")
    print(issued.key)


def _key_list(args: argparse.Namespace, session: Any) -> None:
    from gateway.api.schemas_admin import KeyOut
    from gateway.services.keys import list_keys
    from gateway.services.tenants import get_tenant

    tenant = get_tenant(session, ref=args.tenant)
    for key in list_keys(session, tenant_id=tenant.id):
        print(KeyOut.of(key).model_dump_json())


def _key_revoke(args: argparse.Namespace, session: Any) -> None:
    from gateway.services.keys import revoke_key

    key = revoke_key(session, prefix=args.prefix)
    print(f"key {key.prefix} revoked")
