"""Decode as the entry point: the unified HTTP contract, capacity of both roles, mixed versions.

Real processes and real Mooncake TCP transfers. Greedy decoding through prefill -> decode must
give exactly the text the unified engine gives: the KV decode reads is the KV prefill computed.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from disagg_harness import (
    MODEL,
    PAGE,
    Role,
    capacity,
    complete,
    decode,
    metric,
    prefill,
    running,
)

P_V1 = prefill(pool_tokens=256)
P_V2 = prefill({"KVGUARD_DRILL_PROTOCOL_VERSION": "2"}, pool_tokens=256, allow_fault_drills=True)
D_OK = decode(P_V1, pool_tokens=512)
D_V1_TO_V2 = decode(P_V2, pool_tokens=512)
D_V2_TO_V1 = decode(
    P_V1, {"KVGUARD_DRILL_PROTOCOL_VERSION": "2"}, pool_tokens=512, allow_fault_drills=True
)
UNIFIED = Role("unified", {"page_size": PAGE, "pool_tokens": 512})


@pytest.fixture(scope="module", autouse=True)
def processes(tiny_checkpoint: str) -> Iterator[None]:
    roles = [P_V1, P_V2, D_OK, D_V1_TO_V2, D_V2_TO_V1, UNIFIED]
    # The mismatched decodes never become ready: start them, but wait only for the good path.
    for role in (D_V1_TO_V2, D_V2_TO_V1):
        role.spawn(tiny_checkpoint)
    try:
        with running(tiny_checkpoint, P_V1, P_V2, D_OK, UNIFIED):
            for role in (D_V1_TO_V2, D_V2_TO_V1):
                role.wait_healthy()
            yield
    finally:
        for role in roles:
            role.stop()


def _body(prompt: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, **fields}


def _text(role: Role, prompt: str, **fields: Any) -> str:
    response = httpx.post(role.url + "/v1/completions", json=_body(prompt, **fields), timeout=60)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_capacity_reports_both_roles_and_the_pair_limit() -> None:
    cap = capacity(D_OK)
    assert cap["role"] == "decode" and cap["unavailable"] is None
    roles = {r["role"]: r for r in cap["roles"]}
    assert set(roles) == {"decode", "prefill"}
    assert roles["decode"]["pool_tokens"] == 512 and roles["prefill"]["pool_tokens"] == 256
    assert roles["prefill"]["protocol_version"] == 1 and roles["prefill"]["age_s"] < 5
    assert cap["max_request_tokens"] == 256  # the largest request the pair can serve
    models = httpx.get(D_OK.url + "/v1/models").json()["data"]
    assert models[0]["max_model_len"] == 256
    over = complete(D_OK, "x" * 250, max_tokens=10, request_id="over")
    assert over.status_code == 400 and over.json()["error"]["code"] == "context_length_exceeded"
    assert capacity(D_OK)["free_pages"] == 512 // PAGE  # refused before reserving anything


def test_greedy_text_equals_the_unified_engine() -> None:
    for prompt in ("hello there", "the quick brown fox " * 4, "z" * 150):
        assert _text(D_OK, prompt) == _text(UNIFIED, prompt)


def test_proof_in_body_and_final_stream_chunks() -> None:
    response = complete(D_OK, "prove it", max_tokens=6, request_id="proof-1")
    proof = response.json()["kvguard"]["handoff"]
    assert proof["outcome"] == "ok" and proof["accepted"] is True
    assert proof["reserved_tokens"] == proof["transferred_tokens"] == len("prove it") + 1
    assert proof["checks"] == [
        "identity",
        "outcome",
        "transfer_range",
        "page_generations",
        "checksum",
    ]
    assert proof["skipped_checks"] == []
    body = _body("prove it", max_tokens=6, stream=True, stream_options={"include_usage": True})
    events: list[Any] = []
    with httpx.stream("POST", D_OK.url + "/v1/completions", json=body, timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]"
    finish, usage = events[-3], events[-2]
    assert finish["choices"][0]["finish_reason"] in ("length", "stop")
    assert finish["kvguard"]["handoff"]["transferred_tokens"] == proof["transferred_tokens"]
    assert usage["kvguard"] == finish["kvguard"]
    unified = complete(UNIFIED, "prove it", max_tokens=6, request_id="proof-2").json()
    assert unified["kvguard"] == {"role": "unified", "handoff": None}


def test_n_choices_and_penalties_through_prefill_and_decode() -> None:
    body = _body("abc", n=2, presence_penalty=0.5, frequency_penalty=0.5)
    answer = httpx.post(D_OK.url + "/v1/completions", json=body, timeout=60).json()
    unified = httpx.post(UNIFIED.url + "/v1/completions", json=body, timeout=60).json()
    assert [c["text"] for c in answer["choices"]] == [c["text"] for c in unified["choices"]]
    assert capacity(D_OK)["free_pages"] == 512 // PAGE


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [("logprobs", 1, "logprobs"), ("logit_bias", {"65": 5}, "logit_bias")],
)
def test_what_the_handoff_cannot_carry_is_refused_by_name(
    field: str, value: Any, param: str
) -> None:
    # Prefill samples the first token; protocol version 1 carries neither its logprobs nor the
    # biases: refused by name, never a first token without them.
    refused = httpx.post(D_OK.url + "/v1/completions", json=_body("abc", **{field: value}))
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "unsupported_parameter" and error["param"] == param


def test_concurrent_requests_equal_sequential_ones() -> None:
    prompts = [f"prompt number {i} " * (i + 1) for i in range(6)]
    sequential = [_text(D_OK, p) for p in prompts]

    async def together() -> list[str]:
        async with httpx.AsyncClient(base_url=D_OK.url, timeout=60) as client:
            responses = await asyncio.gather(
                *(client.post("/v1/completions", json=_body(p)) for p in prompts)
            )
        return [r.json()["choices"][0]["text"] for r in responses]

    assert asyncio.run(together()) == sequential
    assert capacity(D_OK)["free_pages"] == 512 // PAGE


@pytest.mark.parametrize(
    ("role", "local", "remote"),
    [(D_V1_TO_V2, 1, 2), (D_V2_TO_V1, 2, 1)],
    ids=["v1-decode", "v2-decode"],
)
def test_mixed_protocol_versions_fail_closed_with_a_clear_error(
    role: Role, local: int, remote: int
) -> None:
    cap = capacity(role)
    assert cap["max_request_tokens"] == 0
    assert "protocol mismatch" in cap["unavailable"]
    response = complete(role, "hello", max_tokens=4, request_id="mixed")
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["code"] == "handoff_protocol_mismatch"
    assert f"speaks version {local}, the peer sent {remote}" in error["message"]
    assert capacity(role)["free_pages"] == 512 // PAGE  # nothing reserved


def test_prefill_refuses_a_message_from_another_version() -> None:
    message = {"protocol_version": 2, "request_id": "r", "anything": "else"}
    response = httpx.post(P_V1.url + "/kv/v1/prefill", json=message, timeout=10)
    assert response.status_code == 409
    body = response.json()
    assert body["protocol_version"] == 1
    assert body["error"]["code"] == "handoff_protocol_mismatch"
    malformed = httpx.post(P_V1.url + "/kv/v1/prefill", json={"protocol_version": 1}, timeout=10)
    assert malformed.status_code == 400
    assert malformed.json()["error"]["code"] == "handoff_malformed_message"
    assert metric(P_V1, "kvguard_engine_handoffs_total", outcome="failed") == 0


def test_prefill_is_not_an_entry_point() -> None:
    response = httpx.post(P_V1.url + "/v1/completions", json=_body("hi"), timeout=10)
    assert response.status_code == 404


@pytest.mark.parametrize(
    ("role", "fault"), [("decode", "skip_checksum"), ("prefill", "legacy_reject_handoff")]
)
def test_faults_need_allow_fault_drills(tiny_checkpoint: str, role: str, fault: str) -> None:
    argv = [sys.executable, "-m", "kvguard", "backend", role, "--model", tiny_checkpoint]
    argv += ["--port", "1", "--fault", fault]
    if role == "decode":
        argv += ["--prefill-url", P_V1.url]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"kvguard backend {role}: cannot start" in result.stderr
    assert "need --allow-fault-drills" in result.stderr
