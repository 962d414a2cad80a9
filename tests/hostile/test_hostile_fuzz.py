"""Property-based fuzzing of the gateway's and the engines' HTTP APIs from their OpenAPI schemas.

Attacker: a client that sends every shape an operation's schema admits and every way of breaking
it, to each operation of the gateway (with a live tenant key, and the admin token for
``/admin``), of a ``kvguard backend unified`` process reached directly, and of a
``kvguard backend prefill`` process's internal handoff API (``/kv/v1/decode``, ``/prefill``,
``/abort``)
as anything on the engines' network could call it. The engines run without a credential here, so
the generated requests reach their parsers and compute (the credential is
``test_hostile_engine_auth``'s).

How: schemathesis generates requests that fit each schema (positive) and requests that break it
(negative), sent over real HTTP on 127.0.0.1 to the real servers (the gateway under uvicorn as
``kvguard gateway`` runs it, canary on, routing to the real engine); positive completions name the
served model, so they run on the engine. Prefill's routes read their raw body, so the test gives
its OpenAPI the wire schemas of the handoff messages, with the checkpoint's page geometry and a
closed local port as the transfer target.

Proves: every answer comes within 30 s (no hang) and is not a 5xx; every 4xx is an OpenAI-style
error body with a code; the gateway's chat completions and tenant creation and the engine's
completions and ``/tokenize`` were among the operations fuzzed; at least ten generated handoffs got
through prefill's parser and compute to the (refused) transfer, and afterwards prefill holds no
page (``free_pages == pool_pages``) and still answers.

Derandomized (a fixed seed per operation) and small (``EXAMPLES`` per operation and mode) so the
tier takes a little over a minute on two cores; a failure prints the request to reproduce it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
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

from backend.disagg.protocol import PROTOCOL_VERSION
from kvguard.localservices import free_port
from kvguard.testing import EngineProcess, launch_engine

EXAMPLES = 25
REQUEST_TIMEOUT_S = 30.0
MODES = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
COMPLETIONS = ("/v1/completions", "/v1/chat/completions")
PAGE = 16


def _check(response: Any, where: str, case: Any) -> None:
    status = response.status_code
    text = response.content[:500]
    assert status < 500, f"{where}: {status} {text!r}\nreproduce: {case.as_curl_command()}"
    if status >= 400:
        body = json.loads(response.content)
        if case.operation.path.startswith("/kv/v1/"):
            body.pop("protocol_version", None)  # the prefill role's refusals name its version
        assert set(body) == {"error"} and set(body["error"]) == ERROR_FIELDS, (where, body)
        assert isinstance(body["error"]["code"], str) and body["error"]["code"], (where, body)


Headers = Callable[[str], dict[str, str]]
Adjust = Callable[[Any, GenerationMode], None]
Seen = list[tuple[str, int, bytes]]  # (path, status, the first bytes of the body) per request


def _fuzz(
    base_url: str,
    *,
    headers_for: Headers,
    adjust: Adjust,
    schema: Any = None,
    seen: Seen | None = None,
) -> list[str]:
    """Fuzz every operation in both modes (of ``base_url``'s own OpenAPI unless ``schema`` is
    given); returns the operations fuzzed, and appends every answer to ``seen``."""
    schema = schema or schemathesis.openapi.from_url(base_url + "/openapi.json")
    fuzzed = []
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in MODES:
            try:
                fuzzed.append(_fuzz_operation(operation, mode, base_url, headers_for, adjust, seen))
            except Unsatisfiable:
                # nothing to break: no parameters and no body (e.g. GET /health)
                assert not mode.is_positive, operation.path
    return fuzzed


def _fuzz_operation(
    operation: Any,
    mode: GenerationMode,
    base_url: str,
    headers_for: Headers,
    adjust: Adjust,
    seen: Seen | None,
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
        if seen is not None:
            seen.append((operation.path, response.status_code, response.content[:500]))
        _check(response, where, case)

    run()
    return where


def _real_model(case: Any, mode: GenerationMode) -> None:
    """Positive completions name the served model, so they go past routing into the engine."""
    if mode.is_positive and case.operation.path in COMPLETIONS and isinstance(case.body, dict):
        case.body["model"] = ENGINE_MODEL


@pytest.fixture
def fuzz_gateway(sqlite_url: str, engine: EngineProcess) -> Iterator[ServedGateway]:
    # The fuzzer sends wrong admin tokens and keys by the hundred: the throttles would answer
    # 429s (test_hostile_secrets and test_hostile_forwarded test them).
    settings = gateway_settings(
        sqlite_url,
        engine.url,
        engine_timeout_s=1.0,
        operator_failures_per_minute=100_000,
        auth_failures_per_minute=100_000,
    )
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


def _int(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


def _bool() -> dict[str, Any]:
    return {"type": "boolean"}


def _obj(**fields: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": fields,
        "required": list(fields),
        "additionalProperties": False,
    }


def _whole(value: Any) -> Any:
    """``1.0`` as ``1``, all through a body: JSON Schema's ``integer`` admits ``1.0``, the handoff
    codec does not (a 400 that would stop a generated request at the parser)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_whole(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    return value


def _wire_integers(case: Any, mode: GenerationMode) -> None:
    if mode.is_positive:
        case.body = _whole(case.body)


def _handoff_bodies(checkpoint: str, endpoint: str) -> dict[str, dict[str, Any]]:
    """Request body schemas (and one valid example) of the prefill role's three operations, after
    ``backend.disagg.protocol``. Its OpenAPI has none: the routes read the raw body so that the
    protocol version is checked before anything else. Handoffs name one transfer target (the
    example announcement's: the checkpoint's geometry, ``endpoint`` a closed local port), which
    the test announces first, so requests that fit reach the compute and a transfer that fails at
    once; generated announcements name another endpoint, so they never displace it."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    geometry = {
        "num_layers": config["num_hidden_layers"],
        "page_size": PAGE,
        "num_kv_heads": config["num_key_value_heads"],
        "head_dim": config["head_dim"],
        "dtype": config["dtype"],
    }
    layout = _obj(**{k: {"const": v} for k, v in geometry.items()}, num_pages=_int(1, 64))
    sampling = _obj(
        max_tokens=_int(1, 8),
        temperature={"type": "number", "minimum": 0, "maximum": 2},
        top_p={"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        seed={"anyOf": [{"type": "null"}, _int(0, 2**31)]},
        stop_token_ids={"type": "array", "items": _int(0, 257), "maxItems": 2},
        # [token id, bias] pairs (ids and biases both drawn within 0..100: valid for the model)
        logit_bias={
            "type": "array",
            "items": {"type": "array", "items": _int(0, 100), "minItems": 2, "maxItems": 2},
            "maxItems": 2,
        },
        logprobs={"anyOf": [{"type": "null"}, _int(0, 5)]},
        # none, any JSON object, or a schema: prefill samples the first token under it
        grammar={
            "anyOf": [
                {"type": "null"},
                _obj(kind={"const": "json_object"}, schema={"type": "null"}, strict=_bool()),
                _obj(
                    kind={"const": "json_schema"},
                    schema={"enum": ['{"type":"object"}', '{"enum":[1,2]}', '{"type":"array"}']},
                    strict=_bool(),
                ),
            ]
        },
    )
    name = {"type": "string", "minLength": 1, "maxLength": 12}
    target = {
        "endpoint": endpoint,
        "instance_id": "i1",
        "channel": "sealed",
        "bases": [4096],
        "layout": {**geometry, "num_pages": 64},
        "max_batch_pages": 2,
    }
    prefill = _obj(
        protocol_version={"const": PROTOCOL_VERSION},
        request_id=name,
        tenant=name,
        # one page of prompt: the schema cannot say reserved == len(prompt) == pages x page
        prompt_ids={"type": "array", "items": _int(0, 257), "minItems": PAGE, "maxItems": PAGE},
        sampling=sampling,
        reserved_tokens={"const": PAGE},
        pages={
            "type": "array",
            "items": _obj(page_id=_int(0, 63), generation=_int(1, 3)),
            "minItems": 1,
            "maxItems": 1,
        },
        target={"const": target},
        # leases long enough for the compute: a generated 1e-300 s ends the handoff at the lease,
        # before the transfer this test means to reach (most draws did; the count below was luck)
        lease_s={"type": "number", "minimum": 0.5, "maximum": 2},
        seal_key={"type": "string", "pattern": "^[0-9a-f]{64}$"},
    )
    announced = _obj(
        endpoint={"const": f"127.0.0.1:{int(endpoint.rpartition(':')[2]) + 1}"},
        instance_id=name,
        channel={"enum": ["sealed", "open"]},
        bases={"type": "array", "items": _int(1, 2**40), "minItems": 1, "maxItems": 2},
        layout=layout,
        max_batch_pages=_int(1, 4),
    )
    example = {
        "protocol_version": PROTOCOL_VERSION,
        "request_id": "r1",
        "tenant": "t1",
        "prompt_ids": list(range(65, 85)),
        "sampling": {
            "max_tokens": 4,
            "temperature": 0.0,
            "top_p": 1.0,
            "seed": None,
            "stop_token_ids": [257],
            "logit_bias": [[65, 2.5]],
            "logprobs": 2,
            "grammar": {"kind": "json_schema", "schema": '{"type":"object"}', "strict": True},
        },
        "reserved_tokens": 20,
        "pages": [{"page_id": 0, "generation": 1}, {"page_id": 1, "generation": 1}],
        "target": target,
        "lease_s": 2.0,
        "seal_key": "ab" * 32,
    }
    abort = _obj(protocol_version={"const": PROTOCOL_VERSION}, request_id=name, instance_id=name)
    announce = _obj(protocol_version={"const": PROTOCOL_VERSION}, target=announced)
    return {
        "/kv/v1/prefill": {"schema": prefill, "example": example},
        "/kv/v1/abort": {"schema": abort},
        "/kv/v1/decode": {
            "schema": announce,
            "example": {"protocol_version": PROTOCOL_VERSION, "target": target},
        },
    }


@pytest.fixture(scope="module")
def prefill_role(tiny_checkpoint: str) -> Iterator[EngineProcess]:
    proc = launch_engine(tiny_checkpoint, role="prefill", pool_tokens=512, page_size=PAGE)
    yield proc
    proc.stop()


def test_fuzz_the_prefill_role(prefill_role: EngineProcess, tiny_checkpoint: str) -> None:
    url = prefill_role.url
    spec = httpx.get(url + "/openapi.json", timeout=10).json()
    bodies = _handoff_bodies(tiny_checkpoint, f"127.0.0.1:{free_port()}")
    # The target every generated handoff names, announced as a decode would.
    announced = httpx.post(url + "/kv/v1/decode", json=bodies["/kv/v1/decode"]["example"])
    assert announced.status_code == 200, announced.text
    for path, media in bodies.items():
        spec["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": media},
        }
    seen: list[tuple[str, int, bytes]] = []
    schema = schemathesis.openapi.from_dict(spec)
    fuzzed = _fuzz(
        url, headers_for=lambda path: {}, adjust=_wire_integers, schema=schema, seen=seen
    )
    assert any(w.startswith("POST /kv/v1/prefill") for w in fuzzed)
    assert any(w.startswith("POST /kv/v1/abort") for w in fuzzed)
    assert any(w.startswith("POST /kv/v1/decode") for w in fuzzed)
    # Generated requests went past the parser, through the compute, to the (refused) transfer.
    answers = [body for path, status, body in seen if path == "/kv/v1/prefill" and status == 200]
    assert sum(b"transfer failed" in body for body in answers) >= 10, answers[:3]
    # No handoff is left holding pages, and the role still serves.
    capacity = httpx.get(url + "/engine/capacity", timeout=10).json()
    assert capacity["free_pages"] == capacity["pool_pages"], capacity
