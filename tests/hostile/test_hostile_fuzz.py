"""Property-based fuzzing of the gateway's and the engine's HTTP APIs from their OpenAPI schemas.

schemathesis generates requests that fit each operation's schema (positive) and requests that
break it (negative); each is sent over real HTTP on 127.0.0.1 to the real servers: the gateway
under uvicorn as ``kvguard gateway`` runs it (canary on, routing to the real engine), and a real
``kvguard backend unified`` process. Every answer must come within the timeout (no hang), must
not be a 5xx, and every 4xx must be an OpenAI-style error body.

Derandomized (a fixed seed per operation) and small (``EXAMPLES`` per operation and mode) so the
tier takes about a minute on two cores; a failure prints the request to reproduce it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import schemathesis
from hostile_harness import (
    ENGINE_MODEL,
    ERROR_FIELDS,
    ServedGateway,
    gateway_settings,
    served_gateway,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from kvguard.testing import EngineProcess

EXAMPLES = 25
REQUEST_TIMEOUT_S = 30.0
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
COMPLETIONS = ("/v1/completions", "/v1/chat/completions")


def _check(response: Any, where: str, case: Any) -> None:
    status = response.status_code
    text = response.content[:500]
    assert status < 500, f"{where}: {status} {text!r}\nreproduce: {case.as_curl_command()}"
    if status >= 400:
        body = json.loads(response.content)
        assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, (where, body)
        assert isinstance(body["error"]["code"], str) and body["error"]["code"], (where, body)


Headers = Callable[[str], dict[str, str]]
Adjust = Callable[[Any, GenerationMode], None]


def _fuzz(base_url: str, *, headers_for: Headers, adjust: Adjust) -> list[str]:
    """Fuzz every operation in both modes; returns the operations fuzzed."""
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    fuzzed = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in MODES:
            try:
                fuzzed.append(_fuzz_operation(operation, mode, base_url, headers_for, adjust))
            except Unsatisfiable:
                # nothing to break: no parameters and no body (e.g. GET /health)
                assert not mode.is_positive, operation.path
    return fuzzed


def _fuzz_operation(
    operation: Any, mode: GenerationMode, base_url: str, headers_for: Headers, adjust: Adjust
) -> str:
    where = f"{operation.method.upper()} {operation.path} [{mode.value}]"

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        adjust(case, mode)
        response = case.call(
            base_url=base_url, headers=headers_for(operation.path), timeout=REQUEST_TIMEOUT_S
        )
        _check(response, where, case)

    run()
    return where


def _real_model(case: Any, mode: GenerationMode) -> None:
    """Positive completions name the served model, so they go past routing into the engine."""
    if mode.is_positive and case.operation.path in COMPLETIONS and isinstance(case.body, dict):
        case.body["model"] = ENGINE_MODEL


@pytest.fixture
def fuzz_gateway(sqlite_url: str, engine: EngineProcess) -> Iterator[ServedGateway]:
    settings = gateway_settings(sqlite_url, engine.url, engine_timeout_s=1.0)
    with served_gateway(settings) as gateway:
        yield gateway


def test_fuzz_the_gateway(fuzz_gateway: ServedGateway) -> None:
    # a small plan: generated requests that fit it really run on the engine, the rest are 400s
    _, key = fuzz_gateway.create_tenant("fuzz", max_context_tokens=96)
    tenant = {"Authorization": f"Bearer {key}"}

    def headers_for(path: str) -> dict[str, str]:
        return fuzz_gateway.admin if path.startswith("/admin") else tenant

    fuzzed = _fuzz(fuzz_gateway.url, headers_for=headers_for, adjust=_real_model)
    assert any(w.startswith("POST /v1/chat/completions") for w in fuzzed)
    assert any(w.startswith("POST /admin/tenants ") for w in fuzzed)


def test_fuzz_the_engine(engine: EngineProcess) -> None:
    fuzzed = _fuzz(engine.url, headers_for=lambda path: {}, adjust=_real_model)
    assert any(w.startswith("POST /v1/completions") for w in fuzzed)
    assert any(w.startswith("POST /tokenize") for w in fuzzed)
