"""`kvguard load` against the real embedded stack: the bundled engine (``kvguard backend unified``)
and ``kvguard gateway`` (SQLite, canary firewall on) as processes on 127.0.0.1.

Two engines sit behind the gateway: the bundled ``kvguard-tiny``, which copies the marker it is
asked for, and ``broken-copy``, the same weights with the copy head's value projection zeroed,
which cannot. A short
bounded run on the first must pass with zero content failures and zero unexpected statuses (the
over-limit size answered 400 ``context_length_exceeded``, a request carrying another tenant's
marker 400 ``foreign_canary_marker``, a prompt that alone exceeds the limit 400
``context_length_exceeded`` too); the same run on the second must fail on
content, which shows the checks can fail. The load command runs in this process: Locust (and
gevent's monkey-patching) must stay in its worker process.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvguard.cli import main
from kvguard.localservices import free_port
from kvguard.testing import EngineProcess

pytestmark = pytest.mark.slow
BUNDLED_MODEL = Path(__file__).resolve().parents[2] / "backend" / "bundled" / "kvguard-tiny"
ADMIN_TOKEN = "load-test-admin-token-0123456789abcdef"
CANARY_KEY = "load-test-canary-key-0123456789abcdef0123"
LIMIT = 384
# The tenants' ids and every request's marker are the same in each run (seeded_gateway.py): the
# bundled model copies these markers whole at every size the tests send (copy_check.py: the
# first COPY_CHECKED_SLOTS of both tenants, short to near), so a content check fails only when
# the stack does. With fresh draws it damaged about one marker in a few thousand.
SEEDED_GATEWAY = Path(__file__).with_name("seeded_gateway.py")
TENANT_ID_SEED, MARKER_SEED = 1, 1
COPY_CHECKED_SLOTS = 300


def _wait_models(url: str, proc: subprocess.Popen[bytes], log: Path, count: int) -> None:
    """Until the gateway is up and reports ``count`` routable engines."""
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            engines = httpx.get(url + "/admin/engines", headers=admin, timeout=2).json()
            if sum(bool(e.get("routable")) for e in engines) >= count:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"gateway not routing to {count} engines: {log.read_text()[-3000:]}")


def _engine(model: str, name: str, env: dict[str, str], port: int) -> EngineProcess:
    """``kvguard backend unified`` serving ``model`` as ``name``, started (not yet healthy)."""
    argv = [sys.executable, "-m", "kvguard", "backend", "unified", "--port", str(port)]
    argv += ["--model", model, "--pool-tokens", "2048", "--context-window", str(LIMIT)]
    argv += ["--page-size", "16"]
    engine_env = {**env, "KVGUARD_SERVED_MODEL_NAME": name}
    return EngineProcess(argv, f"http://127.0.0.1:{port}", engine_env)


def _broken_copier(directory: Path) -> str:
    """The bundled model with its copy head's value projection zeroed: the same architecture,
    tokenizer and chat format, but the layer that copies what it matched writes nothing."""
    from safetensors.numpy import load_file, save_file

    directory.mkdir()
    shutil.copy(BUNDLED_MODEL / "config.json", directory / "config.json")
    weights = load_file(str(BUNDLED_MODEL / "model.safetensors"))
    weights["model.layers.1.self_attn.v_proj.weight"][:] = 0.0
    save_file(weights, str(directory / "model.safetensors"))
    return str(directory)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The gateway's URL; its engines: ``kvguard-tiny`` (bundled) and ``broken-copy``."""
    tmp = tmp_path_factory.mktemp("load-stack")
    env = {
        **os.environ,
        "KVGUARD_TORCH_THREADS": "1",
        "KVGUARD_DATA_DIR": str(tmp / "data"),
        "KVGUARD_ADMIN_TOKEN": ADMIN_TOKEN,
        "KVGUARD_CANARY_KEY": CANARY_KEY,
        "KVGUARD_POLL_INTERVAL_S": "0.5",
        "KVGUARD_CAPACITY_STALE_AFTER_S": "10",
        "GLOG_minloglevel": "2",
    }
    port, broken_port = free_port(), free_port()
    engines = [_engine(str(BUNDLED_MODEL), "kvguard-tiny", env, free_port())]
    gateway: subprocess.Popen[bytes] | None = None
    try:
        argv = [sys.executable, str(SEEDED_GATEWAY), str(TENANT_ID_SEED), "--port", str(port)]
        argv += ["--log-level", "warning", "--engine", engines[0].url]
        argv += ["--engine", f"http://127.0.0.1:{broken_port}"]
        log = tmp / "gateway.log"
        with log.open("wb") as out:
            gateway = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        broken = _broken_copier(tmp / "broken-copy")
        engines.append(_engine(broken, "broken-copy", env, broken_port))
        for engine in engines:
            engine.wait_healthy()
        _wait_models(url, gateway, log, count=2)
        yield url
    finally:
        if gateway is not None and gateway.poll() is None:
            gateway.terminate()
            try:
                gateway.wait(15)
            except subprocess.TimeoutExpired:
                gateway.kill()
                gateway.wait()
        for engine in engines:
            engine.stop()


def _load(stack: str, out: Path, *extra: str) -> int:
    argv = ["load", "--gateway", stack, "--users", "3", "--duration", "20s", "--tenants", "2"]
    return main([*argv, "--out", str(out), *extra])


def test_bounded_load_run_passes_every_content_check(
    stack: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVGUARD_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("KVGUARD_CANARY_KEY", CANARY_KEY)
    sizes = "short,mid,near,over,over_prompt,foreign"
    extra = ("--model", "kvguard-tiny", "--max-requests", "24", "--sizes", sizes)
    extra += ("--marker-seed", str(MARKER_SEED))
    status = _load(stack, tmp_path, *extra)
    table, err = capfd.readouterr()
    assert status == 0, table + err
    # The worker's progress lines (one every 2 s while it runs, and one at the end) reach the
    # terminal; the last counts every request.
    progress = [line for line in err.splitlines() if "content-check failures" in line]
    assert progress, err
    assert "requests 24 (" in progress[-1] and progress[-1].endswith(
        "failures 0  content-check failures 0"
    )
    assert "locust" not in sys.modules and "gevent" not in sys.modules  # the caller stays clean

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["requests"] == 24 and summary["requests_unfinished"] == 0
    assert summary["content_check_failures"] == 0 and summary["unexpected_statuses"] == 0
    assert summary["max_model_len"] == LIMIT and summary["tenants"] == 2
    assert summary["marker_seed"] == MARKER_SEED
    for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_latency_ms"):
        assert set(summary[metric]) >= {"p50", "p90", "p99"}, metric
    assert summary["ttft_ms"]["p50"] > 0 and summary["e2e_latency_ms"]["p99"] > 0
    assert summary["output_tokens_per_s"] > 0 and summary["requests_per_s"] > 0
    assert summary["goodput_requests_per_s"] > 0

    sizes = summary["by_size"]
    assert list(sizes) == ["short", "mid", "near", "over", "over_prompt", "foreign"]
    assert all(row["requests"] == 4 for row in sizes.values())
    assert sizes["near"]["total_tokens"] == LIMIT and sizes["over"]["total_tokens"] == LIMIT + 1
    assert sizes["short"]["prompt_tokens"] < sizes["mid"]["prompt_tokens"] < LIMIT
    assert sizes["over_prompt"]["prompt_tokens"] > LIMIT  # the prompt alone: the incident's case
    assert sizes["over_prompt"]["max_tokens"] == 1
    for name in ("short", "mid", "near"):
        assert sizes[name]["statuses"] == {"200": 4}, name
    assert sizes["over"]["statuses"] == sizes["over_prompt"]["statuses"] == {"400": 4}
    assert sizes["foreign"]["statuses"] == {"400": 4}  # another tenant's marker: refused
    assert summary["good_requests"] == 12

    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert {s["tenant"] for s in samples} == {0, 1}
    codes = {(s["size"], s["code"]) for s in samples if s["status"] == 400}
    assert codes == {
        ("over", "context_length_exceeded"),
        ("over_prompt", "context_length_exceeded"),
        ("foreign", "foreign_canary_marker"),
    }
    assert "CNRY-" not in (tmp_path / "samples.jsonl").read_text()  # no markers in the results

    with (tmp_path / "locust_stats.csv").open() as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    assert {rows[f"chat {n}"]["Request Count"] for n in sizes} == {"4"}
    assert rows["Aggregated"]["Failure Count"] == "0"
    with (tmp_path / "locust_stats_history.csv").open() as f:
        history = list(csv.DictReader(f))
    assert {row["Name"] for row in history} >= {"Aggregated", "chat short"}
    assert max(int(row["User Count"]) for row in history) == 3
    assert (tmp_path / "locust.html").stat().st_size > 0
    assert "PASS" in table and "TTFT ms p50/p90/p99" in table
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    findings = httpx.get(stack + "/admin/canary/findings", headers=admin, timeout=10).json()
    assert [f for f in findings if f["severity"] in ("critical", "high")] == []  # nothing cut


def test_a_model_that_does_not_echo_fails_the_run(
    stack: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVGUARD_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setenv("KVGUARD_CANARY_KEY", CANARY_KEY)
    extra = ("--model", "broken-copy", "--max-requests", "4", "--sizes", "short,over")
    status = _load(stack, tmp_path, *extra)
    table, err = capsys.readouterr()
    assert status == 1, table + err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["content_check_failures"] == 2 and summary["unexpected_statuses"] == 0
    assert summary["failure_reasons"]["content: own marker missing"] == 2
    assert summary["by_size"]["over"]["statuses"] == {"400": 2}
    with (tmp_path / "locust_failures.csv").open() as f:
        failures = list(csv.DictReader(f))
    assert {row["Name"] for row in failures} == {"chat short"}
    assert sum(int(row["Occurrences"]) for row in failures) == 2
    assert all("own marker missing" in row["Error"] for row in failures)
    assert "FAIL" in table


def test_bench_hook_reports_the_near_limit_numbers(
    stack: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from canary.markers import MarkerCodec, MarkerKeyring
    from kvguard.load.runner import bench_long_context

    codec = MarkerCodec(MarkerKeyring({1: CANARY_KEY.encode()}, current=1))
    # The caller's environment names no canary key (as bench.bench_load's does not: its key is
    # only in the stack's environment): the worker must mint with the codec it was handed, not
    # with its environment's (the development key), whose markers the gateway cannot verify and
    # strips from every answer (0 bytes of text, a 200 with 38 completion tokens).
    monkeypatch.delenv("KVGUARD_CANARY_KEY", raising=False)
    row = bench_long_context(
        stack,
        tmp_path,
        codec=codec,
        admin_token=ADMIN_TOKEN,
        users=2,
        max_requests=2,
        model="kvguard-tiny",
        marker_seed=MARKER_SEED,
    )
    assert row["requests"] == 2 and row["max_model_len"] == LIMIT
    assert row["content_check_failures"] == 0 and row["unexpected_statuses"] == 0
    assert LIMIT // 2 < row["prompt_tokens"] < LIMIT
    assert row["output_tokens_per_s"] > 0
    assert 0 < row["ttft_p50_ms"] <= row["ttft_p99_ms"]


LOAD_PACKAGE = Path(__file__).resolve().parents[2] / "kvguard" / "load"


def test_the_locust_cli_runs_the_shipped_locustfile_and_long_context_shape(
    stack: str, tmp_path: Path
) -> None:
    """Locust's own CLI, headless, with the shipped locustfile and shape: the plan is made
    against --host and written where asked (owner-only), the stages send short, then near-limit,
    then over-limit requests (refused as expected: no failure), and Locust writes its CSVs
    including the stats history."""
    env = {**os.environ, "KVGUARD_ADMIN_TOKEN": ADMIN_TOKEN, "KVGUARD_CANARY_KEY": CANARY_KEY}
    plan = tmp_path / "plans" / "plan.json"
    plan.parent.mkdir()
    files = f"{LOAD_PACKAGE / 'locustfile.py'},{LOAD_PACKAGE / 'shape.py'}"
    argv = [str(Path(sys.executable).parent / "locust"), "-f", files, "--headless"]
    argv += ["--host", stack, "-u", "2", "-r", "2", "--kvguard-plan", str(plan)]
    argv += ["--kvguard-model", "kvguard-tiny", "--kvguard-stage-seconds", "3"]
    argv += ["--kvguard-marker-seed", str(MARKER_SEED)]
    argv += ["--csv", str(tmp_path / "run"), "--csv-full-history", "--only-summary"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert plan.stat().st_mode & 0o777 == 0o600
    assert json.loads(plan.read_text())["gateway"] == stack
    with (tmp_path / "run_stats.csv").open() as f:
        rows = {row["Name"]: row for row in csv.DictReader(f)}
    stages = {"chat short", "chat near", "chat over", "chat over_prompt"}
    # The stages run in order: the answered sizes take the run's first slots.
    answered = int(rows["chat short"]["Request Count"]) + int(rows["chat near"]["Request Count"])
    assert answered <= COPY_CHECKED_SLOTS
    assert set(rows) - {"Aggregated"} == stages  # mid is in no stage
    for name in stages:
        assert int(rows[name]["Request Count"]) > 0 and rows[name]["Failure Count"] == "0", name
    with (tmp_path / "run_stats_history.csv").open() as f:
        history = list(csv.DictReader(f))
    assert {row["Name"] for row in history} >= stages | {"Aggregated"}
    assert max(int(row["User Count"]) for row in history) == 2
