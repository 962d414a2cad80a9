"""``kvguard load``: a bounded Locust run through a gateway that checks content, not only statuses.

``kvguard load --gateway URL --users N --duration 30s [--tenants K] [--max-requests M]
[--out DIR]`` prints a progress line every 2 s while it runs, then a summary table, and exits 0
only if every request got the status its size calls for, passed every content check and finished
before the stop timeout (1 otherwise, 2 when the run could not start). ``--write-plan FILE`` only
sets up and writes the plan for Locust's own CLI and web UI (``kvguard.load.locustfile``). The admin
token (``--admin-token`` or ``KVGUARD_ADMIN_TOKEN``) and the canary key (``KVGUARD_CANARY_KEY``)
are the gateway's, as for ``kvguard canary probe``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvguard.load.plan import SIZE_NAMES

# Only light imports here: `kvguard --help` must not pay for httpx, and nothing here may import
# Locust (it runs in a worker process of its own).

EXIT_OK, EXIT_FAILED, EXIT_SETUP = 0, 1, 2


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return value


def _duration(text: str) -> float:
    from kvguard.load.runner import parse_duration

    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def register(subparsers: Any) -> None:
    load = subparsers.add_parser(
        "load",
        help="a bounded Locust load run through a gateway, with content checks",
        description="Streamed chat completions from several synthetic tenants at short, mid, "
        "near-limit and just-over-limit sizes, and with a prompt that alone exceeds the limit; "
        "each request carries its own canary marker and "
        "must get it back. Writes Locust CSV + HTML and summary.json; exit 0 only without "
        "content failures or unexpected statuses.",
    )
    load.add_argument("--gateway", default=None, help="gateway base URL")
    load.add_argument("--users", type=_positive_int, default=4, help="concurrent users")
    load.add_argument("--duration", type=_duration, default=30.0, help="e.g. 30s, 2m")
    load.add_argument("--tenants", type=_positive_int, default=2, help="synthetic tenants")
    load.add_argument("--max-requests", type=_positive_int, default=None, help="stop after M")
    load.add_argument("--out", type=Path, default=Path("load-results"), help="output directory")
    load.add_argument("--admin-token", default=None, help="default: KVGUARD_ADMIN_TOKEN")
    load.add_argument("--model", default=None, help="default: the first model the gateway serves")
    load.add_argument("--spawn-rate", type=float, default=None, help="users/s (default: all)")
    load.add_argument("--tenant-prefix", default="kvguard-load")
    load.add_argument(
        "--sizes",
        default=",".join(SIZE_NAMES),
        help=f"comma-separated among {','.join(SIZE_NAMES)} and foreign (a request carrying "
        "another tenant's marker: must be refused)",
    )
    load.add_argument("--request-timeout", type=float, default=120.0, metavar="SECONDS")
    load.add_argument(
        "--marker-seed",
        type=int,
        default=None,
        help="send the markers of the run whose summary.json names this seed (default: a fresh "
        "seed per run)",
    )
    load.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT bound")
    load.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT bound")
    load.add_argument(
        "--write-plan",
        type=Path,
        default=None,
        metavar="FILE",
        help="only set up (tenants, calibrated sizes) and write the plan to FILE for "
        "`locust -f kvguard/load/locustfile.py --kvguard-plan FILE` (keys valid for a day)",
    )
    load.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    import httpx

    from canary.config import CanarySettings
    from canary.markers import MarkerCodec
    from contracts.settings import CONFIG_ERRORS, settings_error
    from kvguard.load.report import Slo, format_summary, passed
    from kvguard.load.runner import LoadOptions, run_load
    from kvguard.load.setup import LoadSetupError

    try:
        settings = CanarySettings()
    except CONFIG_ERRORS as exc:
        print(f"kvguard load: invalid settings: {settings_error(exc)}", file=sys.stderr)
        return EXIT_SETUP
    url = args.gateway or settings.canary_gateway_url
    if not url:
        print("kvguard load: pass --gateway URL", file=sys.stderr)
        return EXIT_SETUP
    options = LoadOptions(
        gateway=url.rstrip("/"),
        out_dir=args.out,
        users=args.users,
        duration_s=args.duration,
        tenants=args.tenants,
        max_requests=args.max_requests,
        model=args.model,
        spawn_rate=args.spawn_rate,
        tenant_prefix=args.tenant_prefix,
        sizes=tuple(s.strip() for s in args.sizes.split(",") if s.strip()),
        request_timeout_s=args.request_timeout,
        slo=Slo(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms),
        marker_seed=args.marker_seed,
    )
    admin_token = args.admin_token or settings.admin_secret()
    codec = MarkerCodec(settings.keyring())
    if args.write_plan is not None:
        return _write_plan(args.write_plan, options, codec=codec, admin_token=admin_token)
    try:
        summary = run_load(options, codec=codec, admin_token=admin_token)
    except (LoadSetupError, httpx.HTTPError) as exc:
        print(f"kvguard load: the run could not complete: {exc}", file=sys.stderr, flush=True)
        return EXIT_SETUP
    print(format_summary(summary), flush=True)
    print(f"results: {args.out}/summary.json, locust.html, locust_*.csv", flush=True)
    return EXIT_OK if passed(summary) else EXIT_FAILED


def _write_plan(path: Path, options: Any, *, codec: Any, admin_token: str) -> int:
    import dataclasses

    import httpx

    from kvguard.load.runner import PLAN_FILE_KEY_LIFETIME_S, prepare_plan
    from kvguard.load.setup import LoadSetupError

    options = dataclasses.replace(options, key_lifetime_s=PLAN_FILE_KEY_LIFETIME_S)
    try:
        plan = prepare_plan(options, codec=codec, admin_token=admin_token)
    except (LoadSetupError, httpx.HTTPError) as exc:
        print(f"kvguard load: the plan could not be made: {exc}", file=sys.stderr, flush=True)
        return EXIT_SETUP
    plan.save(path)
    print(f"plan: {path} (tenant keys inside, readable by you only)")
    print(
        f"run: locust -f kvguard/load/locustfile.py --host {plan.gateway} --kvguard-plan {path}"
        " [-f ...,kvguard/load/shape.py for the long-context ramp]",
        flush=True,
    )
    return EXIT_OK
