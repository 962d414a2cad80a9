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

from backend.disagg.protocol import PROTOCOL_VERSION

# Version skew is drilled with the previous protocol version: a peer that still speaks it is
# the mismatch a rolling upgrade meets (it carries no first-token logprobs or biases).
OLD = PROTOCOL_VERSION - 1
DRILL_OLD = {"KVGUARD_DRILL_PROTOCOL_VERSION": str(OLD)}
P_NEW = prefill(pool_tokens=256)
P_OLD = prefill(DRILL_OLD, pool_tokens=256, allow_fault_drills=True)
D_OK = decode(P_NEW, pool_tokens=512)
D_NEW_TO_OLD = decode(P_OLD, pool_tokens=512)
D_OLD_TO_NEW = decode(P_NEW, DRILL_OLD, pool_tokens=512, allow_fault_drills=True)
UNIFIED = Role("unified", {"page_size": PAGE, "pool_tokens": 512})


@pytest.fixture(scope="module", autouse=True)
def processes(tiny_checkpoint: str) -> Iterator[None]:
    roles = [P_NEW, P_OLD, D_OK, D_NEW_TO_OLD, D_OLD_TO_NEW, UNIFIED]
    # The mismatched decodes never become ready: start them, but wait only for the good path.
    for role in (D_NEW_TO_OLD, D_OLD_TO_NEW):
        role.spawn(tiny_checkpoint)
    try:
        with running(tiny_checkpoint, P_NEW, P_OLD, D_OK, UNIFIED):
            for role in (D_NEW_TO_OLD, D_OLD_TO_NEW):
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
    assert roles["prefill"]["protocol_version"] == PROTOCOL_VERSION
    assert roles["prefill"]["age_s"] < 5
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
        "seal",
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


def test_logprobs_and_logit_bias_through_prefill_and_decode() -> None:
    """Prefill samples the first token: the handoff carries the biases it must apply and the
    logprobs it must report, so the pair answers as the unified engine does, first token
    included (its logprobs were refused by name while the handoff could not carry them)."""
    cases = [
        {"logprobs": 3},
        {"logit_bias": {"65": 100}},  # "A" for every token, the first (prefill's) included
        {"logprobs": 2, "logit_bias": {"66": 5}, "n": 2, "temperature": 0.9, "seed": 11},
    ]
    for fields in cases:
        body = _body("abc", **{**fields, "max_tokens": 6})
        pair = httpx.post(D_OK.url + "/v1/completions", json=body, timeout=60)
        assert pair.status_code == 200, (fields, pair.text)
        unified = httpx.post(UNIFIED.url + "/v1/completions", json=body, timeout=60).json()
        choices, expected = pair.json()["choices"], unified["choices"]
        assert [c["text"] for c in choices] == [c["text"] for c in expected], fields
        for got, want in zip(choices, expected, strict=True):
            if "logprobs" not in fields:
                assert got["logprobs"] is None
                continue
            assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
            assert len(got["logprobs"]["tokens"]) == 6  # one entry per token, the first too
            assert got["logprobs"]["token_logprobs"] == pytest.approx(
                want["logprobs"]["token_logprobs"], abs=1e-4
            )
            assert [sorted(t) for t in got["logprobs"]["top_logprobs"]] == [
                sorted(t) for t in want["logprobs"]["top_logprobs"]
            ]
    assert _text(D_OK, "abc", logit_bias={"65": 100}, max_tokens=6) == "A" * 6
    assert capacity(D_OK)["free_pages"] == 512 // PAGE


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
    [(D_NEW_TO_OLD, PROTOCOL_VERSION, OLD), (D_OLD_TO_NEW, OLD, PROTOCOL_VERSION)],
    ids=["new-decode", "old-decode"],
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
    for version in (OLD, PROTOCOL_VERSION + 1):
        message = {"protocol_version": version, "request_id": "r", "anything": "else"}
        response = httpx.post(P_NEW.url + "/kv/v1/prefill", json=message, timeout=10)
        assert response.status_code == 409
        body = response.json()
        assert body["protocol_version"] == PROTOCOL_VERSION
        assert body["error"]["code"] == "handoff_protocol_mismatch"
    malformed = httpx.post(
        P_NEW.url + "/kv/v1/prefill", json={"protocol_version": PROTOCOL_VERSION}, timeout=10
    )
    assert malformed.status_code == 400
    assert malformed.json()["error"]["code"] == "handoff_malformed_message"
    assert metric(P_NEW, "kvguard_engine_handoffs_total", outcome="failed") == 0


def test_prefill_is_not_an_entry_point() -> None:
    response = httpx.post(P_NEW.url + "/v1/completions", json=_body("hi"), timeout=10)
    assert response.status_code == 404


@pytest.mark.parametrize(
    ("role", "fault"), [("decode", "skip_checksum"), ("prefill", "legacy_reject_handoff")]
)
def test_faults_need_allow_fault_drills(tiny_checkpoint: str, role: str, fault: str) -> None:
    argv = [sys.executable, "-m", "kvguard", "backend", role, "--model", tiny_checkpoint]
    argv += ["--port", "1", "--fault", fault]
    if role == "decode":
        argv += ["--prefill-url", P_NEW.url]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert f"kvguard backend {role}: cannot start" in result.stderr
    assert "need --allow-fault-drills" in result.stderr
