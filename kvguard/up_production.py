"""`kvguard up --profile production-like`: compose.yaml's topology as local processes.

Lifecycle: start PostgreSQL and Redis (private, temp dirs) -> run ``kvguard admin migrate`` once
-> start Prometheus (scraping every role with the gateway's metrics token, loading the committed
alert rules) -> supervise prefill, decode, the gateway replicas (``KVGUARD_MODE=production``,
migrations off in the gateways) and the canary probe runner (every ``PROBE_INTERVAL_S`` against
the first replica; healthy by its heartbeat file) -> issue a demo key -> watch -> on exit stop the
roles, then Prometheus, Redis and PostgreSQL (their data is discarded). Not here: Grafana, the
OTel collector and the load balancer in front of the replicas (each replica is printed with its
own URL). Each role's command is compose.yaml's apart from hosts and ports
(``tests/ops/test_ops_up_production.py`` holds the two together); the KV transport differs: on
one host the loopback transport bound to 127.0.0.1, between compose's containers Mooncake.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

from kvguard.localservices import postgres_server, prometheus_server, redis_server
from kvguard.supervisor import RoleSpec, Supervisor
from kvguard.up import banner, issue_demo_key

ENGINE_NAME = "bundled"  # as in compose.yaml, so dashboards and alerts read the same
MODEL = "kvguard-tiny"  # the bundled model's served name (compose.yaml's probe --model)
SCRAPE_INTERVAL = "2s"
PROBE_INTERVAL_S = "60"  # as compose.yaml's KVGUARD_CANARY_PROBE_INTERVAL_S
MIGRATE = ["admin", "migrate"]  # compose.yaml's migrate service


def production_env(database_url: str, redis_url: str, engine_url: str) -> dict[str, str]:
    """The gateway's (and admin's) environment, with fresh secrets for this run."""
    engine = {"name": ENGINE_NAME, "kind": "bundled", "base_url": engine_url}
    return {
        **os.environ,
        "KVGUARD_MODE": "production",
        "KVGUARD_DATABASE_URL": database_url,
        "KVGUARD_REDIS_URL": redis_url,
        "KVGUARD_ADMIN_TOKEN": secrets.token_urlsafe(32),
        "KVGUARD_METRICS_TOKEN": secrets.token_urlsafe(32),
        "KVGUARD_CANARY_KEY": secrets.token_urlsafe(48),
        "KVGUARD_CANARY_KEY_ID": "1",
        "KVGUARD_ENGINE_TOKEN": secrets.token_urlsafe(32),
        "KVGUARD_MIGRATE_ON_START": "false",
        "KVGUARD_ENGINES": json.dumps([engine]),
    }


def production_roles(args: argparse.Namespace, gateway_env: dict[str, str]) -> list[RoleSpec]:
    kvguard = [sys.executable, "-m", "kvguard"]
    host = args.host
    backend_env = {
        **os.environ,
        "KVGUARD_MODE": "production",
        "KVGUARD_ENGINE_TOKEN": gateway_env["KVGUARD_ENGINE_TOKEN"],
        # One host: KV moves over the loopback transport, its port bound to 127.0.0.1 whatever
        # --host says (Mooncake would listen on every interface), every transfer sealed; prefill
        # writes KV only to the target decode announces there.
        "KVGUARD_TRANSPORT": "loopback",
        "KVGUARD_TRANSFER_BIND": "127.0.0.1",
        "KVGUARD_DECODE_PEERS": json.dumps(["127.0.0.1"]),
    }
    prefill_url = f"http://{host}:{args.prefill_port}"
    roles = [
        RoleSpec(
            name="backend (prefill)",
            argv=[*kvguard, "backend", "prefill", "--host", host, "--port", str(args.prefill_port)],
            url=prefill_url,
            env=backend_env,
        ),
        RoleSpec(
            name="backend (decode)",
            argv=[*kvguard, "backend", "decode", "--host", host]
            + ["--port", str(args.backend_port), "--prefill-url", prefill_url],
            url=f"http://{host}:{args.backend_port}",
            env=backend_env,
        ),
    ]
    for replica in range(args.gateway_replicas):
        port = args.port + replica
        roles.append(
            RoleSpec(
                name=f"gateway {replica + 1}",
                argv=[*kvguard, "gateway", "--host", host, "--port", str(port)],
                url=f"http://{host}:{port}",
                env=gateway_env,
            )
        )
    roles.append(probe_role(args, gateway_env))
    return roles


def heartbeat_file(args: argparse.Namespace) -> Path:
    return Path(args.data_dir).resolve() / "canary-probe.heartbeat"


def probe_role(args: argparse.Namespace, gateway_env: dict[str, str]) -> RoleSpec:
    """compose.yaml's canary-probe: the probe loop against the first gateway replica."""
    gateway = f"http://{args.host}:{args.port}"
    heartbeat = heartbeat_file(args)
    argv = [sys.executable, "-m", "kvguard", "canary", "probe", "--gateway", gateway]
    argv += ["--model", MODEL, "--heartbeat", str(heartbeat)]
    env = {
        **os.environ,
        "KVGUARD_MODE": "production",
        "KVGUARD_ADMIN_TOKEN": gateway_env["KVGUARD_ADMIN_TOKEN"],
        "KVGUARD_CANARY_KEY": gateway_env["KVGUARD_CANARY_KEY"],
        "KVGUARD_CANARY_KEY_ID": gateway_env["KVGUARD_CANARY_KEY_ID"],
        "KVGUARD_CANARY_PROBE_INTERVAL_S": PROBE_INTERVAL_S,
    }
    return RoleSpec(name="canary probe", argv=argv, url=gateway, env=env, heartbeat=heartbeat)


def prometheus_config(args: argparse.Namespace, metrics_token: str) -> dict[str, object]:
    """Every role's /metrics; the gateway's with its scrape credential (it holds every tenant's
    series), written into this run's private Prometheus directory."""
    from dashboards.build import ScrapeTarget, engine_targets, scrape_config

    host = args.host
    targets = [
        ScrapeTarget("kvguard-gateway", f"{host}:{args.port + i}")
        for i in range(args.gateway_replicas)
    ]
    roles = [("prefill", f"{host}:{args.prefill_port}"), ("decode", f"{host}:{args.backend_port}")]
    targets += engine_targets(ENGINE_NAME, roles)
    config = scrape_config(targets, ["alerts.yml"], interval=SCRAPE_INTERVAL)
    jobs: list[dict[str, object]] = config["scrape_configs"]
    for job in jobs:
        if job["job_name"] == "kvguard-gateway":
            job["authorization"] = {"type": "Bearer", "credentials": metrics_token}
    return config


def migrate(env: dict[str, str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvguard", *MIGRATE],
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"migrations failed: {done.stderr.strip()[-2000:]}")


def run_production_like(args: argparse.Namespace) -> int:
    from dashboards.build import RULES_FILE

    if args.gateway_replicas < 1:
        print("kvguard up: --gateway-replicas must be at least 1", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as services:
        print("kvguard up: starting PostgreSQL, Redis and Prometheus ...", flush=True)
        postgres = services.enter_context(postgres_server(args.host))
        redis = services.enter_context(redis_server(args.host))
        engine_url = f"http://{args.host}:{args.backend_port}"
        env = production_env(postgres.url, redis.url, engine_url)
        migrate(env)
        rules = {"alerts.yml": RULES_FILE.read_text(encoding="utf-8")}
        prometheus = services.enter_context(
            prometheus_server(
                prometheus_config(args, env["KVGUARD_METRICS_TOKEN"]), rules, args.host
            )
        )
        roles = production_roles(args, env)
        heartbeat_file(args).unlink(missing_ok=True)  # healthy only once this run's probe beats

        def after_start() -> str:
            return _banner(env, roles, prometheus.url, postgres.url, redis.url)

        return Supervisor(roles).run(after_start)
    return 1  # unreachable: the with-block returns; keeps type checkers content


def _banner(
    env: dict[str, str], roles: list[RoleSpec], prometheus: str, postgres: str, redis: str
) -> str:
    gateways = [r.url for r in roles if r.name.startswith("gateway")]
    decode = next(r.url for r in roles if r.name == "backend (decode)")
    lines = [
        banner(gateways[0], decode, issue_demo_key(env), env["KVGUARD_ENGINE_TOKEN"]),
        "",
        "Gateway replicas (shared PostgreSQL and Redis): " + ", ".join(gateways),
        f"Prometheus (every role scraped, alert rules loaded): {prometheus}",
        f"Canary probes (every {PROBE_INTERVAL_S} s): results on the gateways' /metrics",
        f"PostgreSQL: {postgres}",
        f"Redis: {redis}",
        f"Admin token (this run only): {env['KVGUARD_ADMIN_TOKEN']}",
        f"Metrics token (this run only, for /metrics): {env['KVGUARD_METRICS_TOKEN']}",
        "State lives in temp dirs and is discarded at exit.",
    ]
    return "\n".join(lines)
