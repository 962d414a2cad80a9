"""The LiteLLM proxy that the benchmarks compare the gateway with (``bench.bench_proxy``,
``bench.relay_systems``): litellm[proxy] in a virtual environment of its own,
``bench/.venv-litellm-proxy`` (created once, kept; the project's pinned litellm has no installable
``[proxy]`` extra here, and a second litellm must not change the project's pins), run offline
(``OFFLINE_ENV``) in front of one OpenAI-compatible engine behind its master-key check."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvguard.localservices import free_port

LITELLM_VERSION = "1.80.0"
LITELLM_VENV = Path(__file__).resolve().parent / ".venv-litellm-proxy"
# No "llama" in any model name: litellm's token counter stalls on names that contain it.
PROXY_MODEL = "bench-tiny"
PROXY_KEY = "sk-bench-proxy-master-key-0123456789"
OFFLINE_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_OFFLINE_MODE": "true"}


def ensure_litellm_venv(venv: Path = LITELLM_VENV) -> str | None:
    """Create the proxy's venv once (cached by a marker file); None if ready, else the reason."""
    marker = venv / f".installed-{LITELLM_VERSION}"
    if marker.exists():
        return None
    print(f"creating {venv} with litellm[proxy]=={LITELLM_VERSION} (once) ...", flush=True)
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(venv)],
        [str(venv / "bin" / "pip"), "install", "-q", f"litellm[proxy]=={LITELLM_VERSION}"],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            return f"`{' '.join(step[-3:])}` failed: {done.stderr.strip()[-800:]}"
    marker.touch()
    return None


def proxy_config(engine_url: str, engine_model: str) -> str:
    return (
        "model_list:\n"
        f"  - model_name: {PROXY_MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{engine_model}\n"
        f"      api_base: {engine_url}/v1\n"
        "      api_key: unused\n"
        "general_settings:\n"
        f"  master_key: {PROXY_KEY}\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
    )


# uvicorn at WARNING, as every kvguard server runs (contracts/http_edge.py): no access log lines.
PROXY_LOG_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"stderr": {"class": "logging.StreamHandler"}},
    "loggers": {
        name: {"handlers": ["stderr"], "level": "WARNING", "propagate": False}
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
    },
}


def start_litellm_proxy(
    engine_url: str, engine_model: str, tmp: Path, *, prefix: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[str], str]:
    """The proxy's process and URL; ``prefix`` runs it under another command (``taskset``)."""
    config = tmp / "litellm.yaml"
    config.write_text(proxy_config(engine_url, engine_model))
    log_config = tmp / "litellm-logging.json"
    log_config.write_text(json.dumps(PROXY_LOG_CONFIG))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OFFLINE_ENV, LITELLM_LOG="ERROR", DISABLE_ADMIN_UI="True", NO_DOCS="True")
    argv = [*prefix, str(LITELLM_VENV / "bin" / "litellm"), "--config", str(config)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    argv += ["--log_config", str(log_config)]
    log = (tmp / "litellm.log").open("w")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    return proc, f"http://127.0.0.1:{port}"
