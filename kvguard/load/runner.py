"""``kvguard load`` end to end, as a library: set-up, the Locust worker process, the summary.

Lifecycle of ``run_load``: tenants, model limit and calibrated sizes (``kvguard.load.setup``) ->
the plan into a private temporary directory -> ``python -m kvguard.load.worker PLAN`` (Locust
and gevent live only in that child; this process never imports them; its progress lines reach
the terminal) -> its samples ->
``summarize`` -> ``summary.json`` next to Locust's CSVs and HTML in the output directory. The
caller decides what a failed run means (the CLI exits non-zero; a benchmark reports it).

``bench_long_context`` is the hook for ``bench/``: a near-limit-only run and the numbers a
long-context benchmark row needs.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from canary.markers import MarkerCodec
from kvguard.load.plan import (
    ALL_SIZE_NAMES,
    SIZE_NAMES,
    LoadPlan,
    draw_marker_seed,
    keyring_text,
)
from kvguard.load.report import Slo, read_samples, summarize
from kvguard.load.setup import GatewaySetup, LoadSetupError, calibrate, describe

KEY_MARGIN_S = 600
PLAN_FILE_KEY_LIFETIME_S = 86400  # a plan file's keys: a day of `locust -f` runs
WORKER_GRACE_S = 120.0
_DURATION_RE = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?")


def parse_duration(text: str) -> float:
    """Seconds in ``text``: ``90``, ``30s``, ``2m``, ``1h``, ``1m30s``."""
    match = _DURATION_RE.fullmatch(text.strip())
    if not text.strip() or match is None or not any(match.groups()):
        raise ValueError(f"not a duration: {text!r} (examples: 30s, 2m, 1m30s)")
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise ValueError("a duration must be positive")
    return total


@dataclass(frozen=True, slots=True)
class LoadOptions:
    gateway: str
    out_dir: Path
    users: int = 4
    duration_s: float = 30.0
    tenants: int = 2
    max_requests: int | None = None
    model: str | None = None
    spawn_rate: float | None = None
    tenant_prefix: str = "kvguard-load"
    sizes: tuple[str, ...] = SIZE_NAMES
    request_timeout_s: float = 120.0
    stop_timeout_s: float = 30.0
    slo: Slo = field(default_factory=Slo)
    key_lifetime_s: int | None = None  # default: the run's duration plus margins
    marker_seed: int | None = None  # default: a fresh one per run (a plan file: none)


def prepare_plan(options: LoadOptions, *, codec: MarkerCodec, admin_token: str) -> LoadPlan:
    unknown = set(options.sizes) - set(ALL_SIZE_NAMES)
    if unknown or not options.sizes:
        raise LoadSetupError(f"sizes must be among {', '.join(ALL_SIZE_NAMES)}")
    if "foreign" in options.sizes and options.tenants < 2:
        raise LoadSetupError("the foreign size needs at least two tenants")
    key_lifetime = options.key_lifetime_s or (
        int(options.duration_s + options.stop_timeout_s) + KEY_MARGIN_S
    )
    timeout = httpx.Timeout(options.request_timeout_s, connect=10.0)
    with httpx.Client(base_url=options.gateway, timeout=timeout) as http:
        gateway = GatewaySetup(http, admin_token=admin_token)
        tenants = tuple(
            gateway.ensure_tenant(f"{options.tenant_prefix}-{i}", key_lifetime_s=key_lifetime)
            for i in range(options.tenants)
        )
        model, limit = gateway.model_limit(tenants[0], options.model)
        calibration = calibrate(gateway, tenants[0], codec, model, limit)
    return LoadPlan(
        gateway=options.gateway,
        model=model,
        limit=limit,
        tenants=tenants,
        sizes=tuple(s for s in calibration.sizes if s.name in options.sizes),
        out_dir=str(options.out_dir),
        users=options.users,
        spawn_rate=options.spawn_rate or float(options.users),
        duration_s=options.duration_s,
        max_requests=options.max_requests,
        request_timeout_s=options.request_timeout_s,
        stop_timeout_s=options.stop_timeout_s,
        prompt_slack=calibration.slack,
        byte_tokens=calibration.byte_tokens,
        marker_seed=options.marker_seed,
    )


def run_worker(plan: LoadPlan, *, codec: MarkerCodec) -> dict[str, Any]:
    """Run the Locust worker on ``plan``, minting markers with ``codec``'s keyring (the one the
    plan was calibrated with, handed over on the worker's stdin); its ``run.json`` (wall time,
    requests issued)."""
    out = Path(plan.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "worker.log"
    with tempfile.TemporaryDirectory(prefix="kvguard-load-") as private:
        plan_path = Path(private) / "plan.json"
        plan.save(plan_path)
        argv = [sys.executable, "-m", "kvguard.load.worker", str(plan_path), "--keyring-stdin"]
        limit = plan.duration_s + plan.stop_timeout_s + WORKER_GRACE_S
        with log.open("wb") as sink:
            try:  # Locust's log to worker.log; the progress lines (stderr) to our terminal
                keyring = keyring_text(codec.keyring).encode()
                done = subprocess.run(argv, stdout=sink, input=keyring, timeout=limit)
            except subprocess.TimeoutExpired as exc:
                raise LoadSetupError(f"the Locust worker ran past {limit:.0f} s") from exc
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-2000:]
        raise LoadSetupError(f"the Locust worker exited {done.returncode}: {tail}")
    run: dict[str, Any] = json.loads((out / "run.json").read_text())
    return run


def run_load(options: LoadOptions, *, codec: MarkerCodec, admin_token: str) -> dict[str, Any]:
    """Set up, run and summarize one load run; the summary is also in ``summary.json``."""
    plan = prepare_plan(options, codec=codec, admin_token=admin_token)
    if plan.marker_seed is None:
        plan = replace(plan, marker_seed=draw_marker_seed())
    run = run_worker(plan, codec=codec)
    samples = read_samples(Path(plan.out_dir) / "samples.jsonl")
    sizes = describe(plan.sizes, plan.limit)
    summary = {
        "gateway": plan.gateway,
        "model": plan.model,
        "max_model_len": plan.limit,
        "users": plan.users,
        "tenants": len(plan.tenants),
        "prompt_token_slack": plan.prompt_slack,
        "marker_seed": plan.marker_seed,  # --marker-seed: the same markers again
        "requests_unfinished": int(run["issued"]) - len(samples),
        **summarize(samples, wall_s=float(run["wall_s"]), slo=options.slo, sizes=sizes),
    }
    (Path(plan.out_dir) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def bench_long_context(
    gateway: str,
    out_dir: Path,
    *,
    codec: MarkerCodec,
    admin_token: str,
    users: int = 4,
    duration_s: float = 30.0,
    max_requests: int | None = None,
    model: str | None = None,
    marker_seed: int | None = None,
) -> dict[str, Any]:
    """A near-limit-only run: output tokens/s and TTFT p50/p99 at the near-limit size."""
    options = LoadOptions(
        gateway=gateway,
        model=model,
        marker_seed=marker_seed,
        out_dir=out_dir,
        users=users,
        duration_s=duration_s,
        max_requests=max_requests,
        sizes=("near",),
    )
    summary = run_load(options, codec=codec, admin_token=admin_token)
    near = summary["by_size"]["near"]
    return {
        "prompt_tokens": near["prompt_tokens"],
        "max_model_len": summary["max_model_len"],
        "requests": summary["requests"],
        "output_tokens_per_s": summary["output_tokens_per_s"],
        "ttft_p50_ms": near["ttft_ms"]["p50"],
        "ttft_p99_ms": near["ttft_ms"]["p99"],
        "content_check_failures": summary["content_check_failures"],
        "unexpected_statuses": summary["unexpected_statuses"],
    }
