"""compose.yaml against what the code really offers (Docker is not available here).

Each kvguard service's command parses with the real ``kvguard`` parser; every KVGUARD_* variable
is a field of the settings class that service builds, and the settings really load from it;
hosts and ports line up between services (health checks included); migrations run once before
the gateways; every long-running service has a health check, the probe runner's a real liveness
signal; Prometheus scrapes the gateway with its metrics token; the mounted files exist and
Prometheus accepts its config.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from backend.config import BackendSettings
from canary.config import CanarySettings
from dashboards import build
from dashboards.alerts import ALERTS
from gateway.config import GatewaySettings
from kvguard.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "compose.yaml").read_text())
SERVICES: dict[str, dict[str, Any]] = COMPOSE["services"]
KVGUARD_SERVICES = {n: s for n, s in SERVICES.items() if s.get("image", "").startswith("kvguard")}
ONE_SHOT = {n for n, s in SERVICES.items() if s.get("restart") == "no"}
SECRETS = {
    "POSTGRES_PASSWORD": "pg-secret",
    "KVGUARD_ADMIN_TOKEN": "admin-token-for-the-compose-test",
    "KVGUARD_METRICS_TOKEN": "metrics-token-for-the-compose-test",
    "KVGUARD_CANARY_KEY": "Kq7-canary-key-3Vn8xLp2-Wd5mR9tB4s6h-compose",
    "KVGUARD_ENGINE_TOKEN": "Eg4-engine-token-8Rw2pQz5-Lm7kT3vN6x",
    "GRAFANA_ADMIN_PASSWORD": "grafana-secret",
}
INTERPOLATION = re.compile(r"\$\{(\w+)(:\?[^}]*)?\}")
HEALTH_URL = re.compile(r"https?://([\w.-]+):(\d+)/")
# otel/opentelemetry-collector-contrib's Dockerfile: USER 10001:10001
COLLECTOR_USER = "10001:10001"


def interpolate(value: str) -> str:
    """Compose's ``${VAR:?message}``, with test secrets; an unknown variable fails the test."""
    return INTERPOLATION.sub(lambda m: SECRETS[m.group(1)], value)


def env_of(service: str) -> dict[str, str]:
    return {k: interpolate(str(v)) for k, v in SERVICES[service].get("environment", {}).items()}


def settings_classes(command: list[str]) -> tuple[type[Any], ...]:
    if command[0] == "backend":
        return (BackendSettings,)
    if command[0] == "canary":
        return (CanarySettings,)
    return (GatewaySettings, CanarySettings)  # the gateway and admin read both


def option(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_every_kvguard_command_parses_with_the_real_parser() -> None:
    assert set(KVGUARD_SERVICES) >= {"migrate", "prefill", "decode", "gateway", "canary-probe"}
    parser = build_parser()
    for name, service in KVGUARD_SERVICES.items():
        try:
            args = parser.parse_args(service["command"])
        except SystemExit:
            pytest.fail(f"{name}: `kvguard {' '.join(service['command'])}` does not parse")
        assert callable(args.handler), name


def test_every_variable_is_a_settings_field() -> None:
    for name, service in KVGUARD_SERVICES.items():
        classes = settings_classes(service["command"])
        fields = {f for cls in classes for f in cls.model_fields}
        for var in env_of(name):
            assert var.startswith("KVGUARD_"), (name, var)
            assert var.removeprefix("KVGUARD_").lower() in fields, (name, var)


def test_settings_load_from_the_compose_environment(
    monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: str
) -> None:
    for var in [v for v in os.environ if v.startswith("KVGUARD_")]:
        monkeypatch.delenv(var)
    for name in ("gateway", "migrate"):
        with monkeypatch.context() as m:
            for var, value in env_of(name).items():
                m.setenv(var, value)
            gateway = GatewaySettings()
            assert gateway.mode.value == "production" and gateway.redis_url
            assert gateway.metrics_secret() == SECRETS["KVGUARD_METRICS_TOKEN"]
            if name == "gateway":  # the firewall runs in the gateway; migrations need no key
                assert CanarySettings().keyring() is not None
    with monkeypatch.context() as m:
        for var, value in env_of("canary-probe").items():
            m.setenv(var, value)
        assert CanarySettings().admin_secret() == SECRETS["KVGUARD_ADMIN_TOKEN"]
    for name in ("prefill", "decode"):
        with monkeypatch.context() as m:
            for var, value in env_of(name).items():
                m.setenv(var, value)
            assert BackendSettings(model=Path(tiny_checkpoint)).mode.value == "production"


def _port(name: str) -> int:
    return int(option(SERVICES[name]["command"], "--port"))


def test_urls_and_ports_line_up() -> None:
    gateway_env = env_of("gateway")
    (engine,) = json.loads(gateway_env["KVGUARD_ENGINES"])
    assert urlsplit(engine["base_url"]).netloc == f"decode:{_port('decode')}"
    assert engine["name"] == build.COMPOSE_ENGINE
    prefill_url = option(SERVICES["decode"]["command"], "--prefill-url")
    assert urlsplit(prefill_url).netloc == f"prefill:{_port('prefill')}"
    for name in ("prefill", "decode", "gateway"):
        assert option(SERVICES[name]["command"], "--host") == "0.0.0.0"
        assert str(_port(name)) in SERVICES[name]["expose"]
    db = urlsplit(gateway_env["KVGUARD_DATABASE_URL"])
    pg = SERVICES["postgres"]["environment"]
    assert (db.hostname, db.port, db.username) == ("postgres", 5432, pg["POSTGRES_USER"])
    assert db.path == "/" + pg["POSTGRES_DB"]
    assert db.password == SECRETS["POSTGRES_PASSWORD"]
    assert urlsplit(gateway_env["KVGUARD_REDIS_URL"]).netloc == "redis:6379"
    otlp = urlsplit(gateway_env["KVGUARD_OTLP_ENDPOINT"])
    collector = yaml.safe_load((REPO / "deploy" / "otel-collector.yaml").read_text())
    http_receiver = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    assert otlp.hostname == "otel-collector" and http_receiver.endswith(f":{otlp.port}")
    nginx = (REPO / "deploy" / "nginx.conf").read_text()
    # re-resolved while running (Docker's DNS), so replicas that come and go are followed
    assert f"server gateway:{_port('gateway')} resolve;" in nginx
    assert "resolver 127.0.0.11 " in nginx and "zone kvguard_gateway " in nginx
    assert SERVICES["lb"]["ports"] == [f"{_port('gateway')}:8000"] and "listen 8000;" in nginx
    # The gateway believes forwarded client addresses from nginx's fixed address only, inside the
    # network's subnet, and nginx sets (never appends to) the header.
    lb_address = SERVICES["lb"]["networks"]["default"]["ipv4_address"]
    assert json.loads(gateway_env["KVGUARD_TRUSTED_PROXIES"]) == [lb_address]
    (subnet,) = COMPOSE["networks"]["default"]["ipam"]["config"]
    assert ipaddress.ip_address(lb_address) in ipaddress.ip_network(subnet["subnet"])
    assert "proxy_set_header X-Forwarded-For $remote_addr;" in nginx
    probe = SERVICES["canary-probe"]["command"]
    assert option(probe, "--gateway") == "http://lb:8000"
    assert option(probe, "--model") == engine["model"]
    datasource = build.grafana_datasource()["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"


def test_prometheus_scrapes_every_role_where_it_listens() -> None:
    config = build.compose_prometheus()
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    (dns,) = jobs["kvguard-gateway"]["dns_sd_configs"]
    assert dns["names"] == ["gateway"] and dns["port"] == _port("gateway")
    engine_targets = {
        (c["labels"]["role"], c["targets"][0]) for c in jobs["kvguard-engine"]["static_configs"]
    }
    assert engine_targets == {
        ("prefill", f"prefill:{_port('prefill')}"),
        ("decode", f"decode:{_port('decode')}"),
    }
    (otel,) = jobs["otel-collector"]["static_configs"]
    assert otel["targets"] == ["otel-collector:8888"]
    assert "8888" in SERVICES["otel-collector"]["expose"]


def test_prometheus_scrapes_the_gateway_with_the_gateways_metrics_token() -> None:
    # /metrics holds every tenant's series: the gateway answers only its metrics token there
    auth = {
        j["job_name"]: j.get("authorization") for j in build.compose_prometheus()["scrape_configs"]
    }
    assert auth["kvguard-gateway"]["type"] == "Bearer"
    (secret,) = SERVICES["prometheus"]["secrets"]
    assert auth["kvguard-gateway"]["credentials_file"] == f"/run/secrets/{secret}"
    assert COMPOSE["secrets"][secret] == {"environment": "KVGUARD_METRICS_TOKEN"}
    assert "KVGUARD_METRICS_TOKEN" in env_of("gateway")


def _container_port(name: str) -> int:
    """Where the service listens inside its container: --port, nginx's listen, else ``ports``."""
    command = SERVICES[name].get("command", [])
    if "--port" in command:
        return _port(name)
    if name == "lb":
        listen = re.search(r"listen (\d+);", (REPO / "deploy" / "nginx.conf").read_text())
        assert listen is not None
        return int(listen.group(1))
    (mapping,) = SERVICES[name]["ports"]
    return int(mapping.split(":")[-1])


def test_health_checks_ask_the_service_itself_on_its_own_port() -> None:
    checked = set()
    for name, service in SERVICES.items():
        test = " ".join(service.get("healthcheck", {}).get("test", []))
        for host, port in HEALTH_URL.findall(test):
            assert (host, int(port)) == ("127.0.0.1", _container_port(name)), (name, test)
            checked.add(name)
    assert checked == {
        "prefill",
        "decode",
        "gateway",
        "lb",
        "prometheus",
        "grafana",
        "alertmanager",
    }


def _probe_check() -> list[str]:
    """canary-probe's health check, and the heartbeat file its command touches."""
    service = SERVICES["canary-probe"]
    heartbeat = option(service["command"], "--heartbeat")
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"] and f"'{heartbeat}'" in test[3], test
    return [test[3], heartbeat]


def _check(code: str, heartbeat: str, path: Path) -> int:
    done = subprocess.run([sys.executable, "-c", code.replace(heartbeat, str(path))], timeout=30)
    return done.returncode


def test_the_probe_runners_health_check_follows_its_heartbeat(tmp_path: Path) -> None:
    """The real probe loop (no gateway to reach: every round fails, the loop lives on) beats; the
    compose check passes on its file and fails on a missing or stale one."""
    code, heartbeat = _probe_check()
    beat = tmp_path / "probe.heartbeat"
    env = {**os.environ, "KVGUARD_MODE": "development", "KVGUARD_CANARY_PROBE_INTERVAL_S": "0.2"}
    argv = [sys.executable, "-m", "kvguard", "canary", "probe", "--gateway", "http://127.0.0.1:9"]
    proc = subprocess.Popen([*argv, "--heartbeat", str(beat)], env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not beat.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        first = beat.stat().st_mtime_ns
        while beat.stat().st_mtime_ns == first:  # touched again after a (failed) round
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(30)
    assert _check(code, heartbeat, beat) == 0
    os.utime(beat, (time.time() - 3600, time.time() - 3600))
    assert _check(code, heartbeat, beat) != 0
    assert _check(code, heartbeat, tmp_path / "missing") != 0


def test_migrations_run_once_before_the_gateways() -> None:
    migrators = [n for n, s in KVGUARD_SERVICES.items() if s["command"][:2] == ["admin", "migrate"]]
    assert migrators == ["migrate"] and "migrate" in ONE_SHOT
    gateway = SERVICES["gateway"]
    assert gateway["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}
    assert env_of("gateway")["KVGUARD_MIGRATE_ON_START"] == "false"
    assert gateway["deploy"]["replicas"] >= 2 and "ports" not in gateway
    assert SERVICES["migrate"]["depends_on"]["postgres"] == {"condition": "service_healthy"}


def test_health_checks_everywhere() -> None:
    expected = {"gateway", "prefill", "decode", "redis", "postgres", "prometheus", "grafana"}
    expected |= {"canary-probe", "alertmanager"}
    assert expected | {"otel-collector", "lb", "migrate"} <= set(SERVICES)
    for name, service in SERVICES.items():
        if name in ONE_SHOT:
            continue
        test = service.get("healthcheck", {}).get("test")
        assert test and test[0] == "CMD", name
        for dependency, condition in service.get("depends_on", {}).items():
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in SERVICES[dependency], (name, dependency)


def test_mounted_files_exist_and_prometheus_accepts_its_config(tmp_path: Path) -> None:
    for name, service in SERVICES.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0] if isinstance(volume, str) else volume["type"]
            if source.startswith("./"):
                assert (REPO / source).exists(), (name, source)
    mounts = dict(v.split(":")[:2] for v in SERVICES["prometheus"]["volumes"] if v.startswith("./"))
    config = yaml.safe_load(
        (
            REPO
            / mounts["./deploy/prometheus.yml"].replace(
                "/etc/prometheus/prometheus.yml", "deploy/prometheus.yml"
            )
        ).read_text()
    )
    assert config["rule_files"] == [mounts["./dashboards/prometheus/alerts.yml"]]
    config["rule_files"] = [str(build.RULES_FILE)]
    (gateway_job,) = [j for j in config["scrape_configs"] if j["job_name"] == "kvguard-gateway"]
    token = tmp_path / "metrics_token"  # promtool checks that the credentials file exists
    token.write_text(SECRETS["KVGUARD_METRICS_TOKEN"])
    gateway_job["authorization"]["credentials_file"] = str(token)
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        ["promtool", "check", "config", str(local)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    provider = build.grafana_dashboards_provider()["providers"][0]
    grafana = dict(v.split(":")[:2] for v in SERVICES["grafana"]["volumes"])
    assert grafana["./dashboards/grafana"] == provider["options"]["path"]


def test_one_image_for_every_role() -> None:
    dockerfile = (REPO / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["kvguard"]' in dockerfile
    for package in ("kvguard", "backend", "gateway", "canary", "migrations"):
        assert f"COPY {package} ./{package}" in dockerfile
    assert {s.get("image") for s in KVGUARD_SERVICES.values()} == {"kvguard:latest"}


def _amtool(*args: str) -> str:
    done = subprocess.run(["amtool", *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_alertmanager_routes_every_kvguard_alert_to_the_receiver_users_point() -> None:
    """The mounted config is the committed one; every rule reaches the ``kvguard`` receiver and
    anything else the ``null`` one (Alertmanager's own ``amtool`` decides); Prometheus sends to
    the service where it listens."""
    service = SERVICES["alertmanager"]
    mounts = dict(v.split(":")[:2] for v in service["volumes"] if v.startswith("./"))
    flag = next(a for a in service["command"] if a.startswith("--config.file="))
    assert mounts["./deploy/alertmanager.yml"] == flag.removeprefix("--config.file=")
    config = str(REPO / "deploy" / "alertmanager.yml")
    assert "SUCCESS" in _amtool("check-config", config)
    for rule in ALERTS:
        labels = [f"alertname={rule.name}", f"severity={rule.severity}"]
        routed = _amtool("config", "routes", "test", f"--config.file={config}", *labels)
        assert routed.split() == ["kvguard"], (rule.name, routed)
    other = _amtool("config", "routes", "test", f"--config.file={config}", "alertname=Watchdog")
    assert other.split() == ["null"]
    (targets,) = build.compose_prometheus()["alerting"]["alertmanagers"][0]["static_configs"]
    assert targets["targets"] == [f"alertmanager:{_container_port('alertmanager')}"]


def _mounts(service: str) -> dict[str, tuple[str, str]]:
    """A service's mounts by target: (type, source), from compose's short or long syntax."""
    mounts = {}
    for volume in SERVICES[service].get("volumes", []):
        if isinstance(volume, dict):
            mounts[volume["target"]] = (volume["type"], volume.get("source", ""))
            continue
        source, target = volume.split(":")[:2]
        kind = "bind" if source.startswith(("./", "/")) else "volume"
        mounts[target] = (kind, source)
    return mounts


def test_every_role_sends_its_traces_to_the_collector_which_keeps_them() -> None:
    """Gateway, decode and prefill export to the collector's OTLP/HTTP receiver (one trace across
    the three); the collector writes them to a file on a named volume, which ``docker compose cp``
    can read (not a tmpfs: it cannot, and the distroless image has no shell to read it with),
    owned by the image's user before the collector starts, and logs a summary. The documented
    ``docker compose cp`` names that file."""
    collector = yaml.safe_load((REPO / "deploy" / "otel-collector.yaml").read_text())
    receiver = collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"]
    for name in ("gateway", "decode", "prefill"):
        otlp = urlsplit(env_of(name)["KVGUARD_OTLP_ENDPOINT"])
        assert otlp.hostname == "otel-collector" and receiver.endswith(f":{otlp.port}"), name
    pipeline = collector["service"]["pipelines"]["traces"]
    assert pipeline["receivers"] == ["otlp"] and "debug" in pipeline["exporters"]
    assert collector["exporters"]["debug"]["verbosity"] == "basic"  # a line per batch, no spans
    (file_exporter,) = [e for e in pipeline["exporters"] if e.startswith("file")]
    path = Path(collector["exporters"][file_exporter]["path"])
    kind, volume = _mounts("otel-collector")[str(path.parent)]
    assert kind == "volume" and volume in COMPOSE["volumes"], (kind, volume)
    sharing = [n for n in SERVICES if ("volume", volume) in _mounts(n).values()]
    (init,) = set(sharing) - {"otel-collector"}
    assert _mounts(init) == {str(path.parent): ("volume", volume)} and init in ONE_SHOT
    assert SERVICES[init]["command"] == ["chown", COLLECTOR_USER, str(path.parent)]
    depends = SERVICES["otel-collector"]["depends_on"][init]
    assert depends == {"condition": "service_completed_successfully"}
    copy = f"docker compose cp otel-collector:{path} "
    for doc in (REPO / "docs" / "operations.md", REPO / "deploy" / "otel-collector.yaml"):
        commands = re.findall(r"docker compose cp \S+ ", doc.read_text())
        assert commands and set(commands) == {copy}, (doc.name, commands)


def test_the_walkthrough_sets_every_variable_compose_requires() -> None:
    """The .env of the operations walk-through (docs/operations.md) names exactly what compose
    refuses to start without (``${VAR:?...}``)."""
    required = {m.group(1) for m in INTERPOLATION.finditer((REPO / "compose.yaml").read_text())}
    readme = (REPO / "docs" / "operations.md").read_text()
    recipe = readme[readme.index("cat > .env <<EOF") : readme.index("   EOF\n")]
    assert set(re.findall(r"^\s+([A-Z_]+)=", recipe, flags=re.MULTILINE)) == required
