"""The prefix cache behind the engine's HTTP API: the namespace comes from the tenant the gateway
names (``X-Kvguard-Tenant``), never from the request body; the shared-prefix drill is refused
unless drills are allowed, and shows what the per-tenant salt prevents."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from kvguard.testing import EngineProcess, launch_engine

MODEL = "tiny-llama"
PROMPT = "You are a helpful assistant for the payroll team. " * 2  # 101 tokens with BOS
HIT_IF_CACHED = (101 - 1) // 16 * 16  # whole 16-token pages, never the last token


@pytest.fixture(scope="module")
def engines(tiny_checkpoint: str) -> Iterator[dict[str, EngineProcess]]:
    env = {"KVGUARD_SERVED_MODEL_NAME": MODEL}
    salted = launch_engine(tiny_checkpoint, pool_tokens=512, page_size=16, env=env)
    drill_env = {**env, "KVGUARD_FAULTS": json.dumps(["shared_prefix_across_tenants"])}
    unsalted = launch_engine(
        tiny_checkpoint, pool_tokens=512, page_size=16, env=drill_env, allow_fault_drills=True
    )
    yield {"salted": salted, "unsalted": unsalted}
    salted.stop()
    unsalted.stop()


def _ask(engine: EngineProcess, tenant: str, **extra: object) -> str:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra}
    response = httpx.post(
        engine.url + "/v1/completions",
        json=body,
        headers={"X-Kvguard-Tenant": tenant},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def _hit_tokens(engine: EngineProcess) -> int:
    text = httpx.get(engine.url + "/metrics", timeout=10).text
    found = re.search(
        r'^kvguard_engine_prefix_cache_tokens_total\{result="hit"\} (\S+)$', text, re.M
    )
    return int(float(found.group(1))) if found else 0


def test_tenants_never_hit_each_others_pages_and_a_tenant_hits_its_own(
    engines: dict[str, EngineProcess],
) -> None:
    engine = engines["salted"]
    first = _ask(engine, "tenant-a")
    assert _hit_tokens(engine) == 0
    assert _ask(engine, "tenant-b") == first  # byte-identical prompt, other tenant: no hit
    assert _hit_tokens(engine) == 0
    assert _ask(engine, "tenant-a") == first  # the same tenant again: its own pages
    assert _hit_tokens(engine) == HIT_IF_CACHED
    shared = httpx.get(engine.url + "/metrics", timeout=10).text
    assert 'kvguard_engine_pool_pages{state="shared"}' in shared


def test_the_drill_puts_every_tenant_in_one_namespace(engines: dict[str, EngineProcess]) -> None:
    engine = engines["unsalted"]
    first = _ask(engine, "tenant-a")
    assert _ask(engine, "tenant-b") == first
    assert _hit_tokens(engine) == HIT_IF_CACHED  # B read A's pages: what the salt prevents
    capacity = httpx.get(engine.url + "/engine/capacity", timeout=10).json()
    assert "shared_prefix_across_tenants" in capacity["faults"]


def test_the_drill_is_refused_without_allow_fault_drills(tiny_checkpoint: str) -> None:
    env = {"KVGUARD_FAULTS": json.dumps(["shared_prefix_across_tenants"])}
    result = subprocess.run(
        [sys.executable, "-m", "kvguard", "backend", "unified", "--model", tiny_checkpoint],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "need --allow-fault-drills" in result.stderr
    decode = subprocess.run(
        [sys.executable, "-m", "kvguard", "backend", "decode", "--model", tiny_checkpoint]
        + ["--prefill-url", "http://127.0.0.1:9", "--allow-fault-drills"],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert decode.returncode == 2 and "applies to prefill, unified" in decode.stderr
