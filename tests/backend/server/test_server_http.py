"""The unified engine over real HTTP on 127.0.0.1: contract, admission, streaming, bad input."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvguard.testing import EngineProcess, launch_engine

POOL_TOKENS = 512
PAGE_SIZE = 16
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: str) -> Iterator[EngineProcess]:
    proc = launch_engine(
        tiny_checkpoint,
        pool_tokens=POOL_TOKENS,
        page_size=PAGE_SIZE,
        env={"KVGUARD_SERVED_MODEL_NAME": MODEL, "KVGUARD_MAX_BODY_BYTES": "65536"},
    )
    yield proc
    proc.stop()


def _post(engine: EngineProcess, path: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    return httpx.post(engine.url + path, json=body, timeout=60, **kw)


def _completion(prompt: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}


def _capacity(engine: EngineProcess) -> dict[str, Any]:
    return httpx.get(engine.url + "/engine/capacity", timeout=10).json()


def _error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_capacity_reports_the_running_pool(engine: EngineProcess) -> None:
    cap = _capacity(engine)
    assert cap["role"] == "unified" and cap["model"] == MODEL
    assert cap["page_size"] == PAGE_SIZE
    assert cap["pool_pages"] == POOL_TOKENS // PAGE_SIZE
    assert cap["pool_tokens"] == POOL_TOKENS
    assert cap["free_pages"] == cap["pool_pages"]
    # The window defaults to the model's (4096) capped by the real pool: no drift.
    assert cap["context_window"] == POOL_TOKENS and cap["max_request_tokens"] == POOL_TOKENS
    assert cap["drift"] is None and cap["faults"] == [] and cap["zero_on_free"] is True
    models = httpx.get(engine.url + "/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, POOL_TOKENS)]


def test_admission_at_the_real_limit(engine: EngineProcess) -> None:
    prompt = "x" * 100
    count = _post(engine, "/tokenize", {"prompt": prompt}).json()["count"]
    assert count == 101  # BOS + 100 bytes
    fits = _post(engine, "/v1/completions", _completion(prompt, max_tokens=POOL_TOKENS - count))
    assert fits.status_code == 200, fits.text
    over = _post(engine, "/v1/completions", _completion(prompt, max_tokens=POOL_TOKENS - count + 1))
    assert over.status_code == 400
    err = _error(over)
    assert err["code"] == "context_length_exceeded"
    assert f"maximum request length is {POOL_TOKENS} tokens" in err["message"]
    assert f"needs {POOL_TOKENS + 1} tokens" in err["message"]


def test_rejection_reserves_nothing(engine: EngineProcess) -> None:
    before = _capacity(engine)["free_pages"]
    far_over = _post(engine, "/v1/completions", _completion("y" * 2000))
    assert far_over.status_code == 400
    assert _capacity(engine)["free_pages"] == before == POOL_TOKENS // PAGE_SIZE


def test_non_streaming_completion_and_usage(engine: EngineProcess) -> None:
    response = _post(engine, "/v1/completions", _completion("hello", max_tokens=6))
    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["finish_reason"] in ("length", "stop")
    assert body["usage"]["prompt_tokens"] == 6
    assert 1 <= body["usage"]["completion_tokens"] <= 6
    assert body["usage"]["total_tokens"] == 6 + body["usage"]["completion_tokens"]


def _stream(engine: EngineProcess, path: str, body: dict[str, Any]) -> list[Any]:
    events: list[Any] = []
    with httpx.stream("POST", engine.url + path, json=body, timeout=60) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_streaming_matches_non_streaming_at_temperature_zero(engine: EngineProcess) -> None:
    body = _completion("stream me", max_tokens=12)
    full = _post(engine, "/v1/completions", body).json()
    events = _stream(
        engine,
        "/v1/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == [] and usage["usage"] == full["usage"]
    finish = events[-3]["choices"][0]["finish_reason"]
    assert finish == full["choices"][0]["finish_reason"]
    text = "".join(e["choices"][0]["text"] for e in events[:-2])
    assert text == full["choices"][0]["text"]


def test_chat_stream_shape(engine: EngineProcess) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "hi"}],
    }
    events = _stream(engine, "/v1/chat/completions", body)
    assert events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] in ("length", "stop")


def test_batched_requests_equal_sequential_ones(engine: EngineProcess) -> None:
    """Continuous batching must not change any request's greedy output."""
    prompts = [f"prompt number {i} " * (i + 1) for i in range(6)]
    sequential = [
        _post(engine, "/v1/completions", _completion(p, max_tokens=10)).json()["choices"][0]["text"]
        for p in prompts
    ]

    async def together() -> list[str]:
        async with httpx.AsyncClient(base_url=engine.url, timeout=60) as client:
            responses = await asyncio.gather(
                *(
                    client.post("/v1/completions", json=_completion(p, max_tokens=10))
                    for p in prompts
                )
            )
        return [r.json()["choices"][0]["text"] for r in responses]

    assert asyncio.run(together()) == sequential


def test_seeded_sampling_is_reproducible(engine: EngineProcess) -> None:
    body = _completion("seeded", max_tokens=10, temperature=1.0, seed=1234)
    first = _post(engine, "/v1/completions", body).json()["choices"][0]["text"]
    second = _post(engine, "/v1/completions", body).json()["choices"][0]["text"]
    assert first == second


def test_stop_sequence_cuts_the_text(engine: EngineProcess) -> None:
    base = _post(engine, "/v1/completions", _completion("stop here", max_tokens=12)).json()
    text = base["choices"][0]["text"]
    if len(text) < 3:
        pytest.fail(f"the test model produced too little text to cut: {text!r}")
    stop = text[2:4]
    cut = _post(engine, "/v1/completions", _completion("stop here", max_tokens=12, stop=stop))
    body = cut.json()
    assert body["choices"][0]["text"] == text[: text.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        (_completion("a", bogus=1), "invalid_request", "bogus"),
        (_completion("a", max_tokens=-1), "invalid_request", "max_tokens"),
        (_completion("a", max_tokens=10**9), "invalid_request", "max_tokens"),
        (_completion("a", temperature="hot"), "invalid_request", "temperature"),
        (_completion(""), "invalid_request", "prompt"),
        ({"model": MODEL}, "invalid_request", "prompt"),
    ],
)
def test_bad_fields_are_400_naming_the_field(
    engine: EngineProcess, body: dict[str, Any], code: str, param: str
) -> None:
    response = _post(engine, "/v1/completions", body)
    assert response.status_code == 400
    err = _error(response)
    assert err["code"] == code and err["param"] == param


def test_malformed_bodies(engine: EngineProcess) -> None:
    headers = {"content-type": "application/json"}
    bad_json = httpx.post(engine.url + "/v1/completions", content=b"{nope", headers=headers)
    assert bad_json.status_code == 400 and _error(bad_json)["code"] == "invalid_request"
    bad_utf8 = httpx.post(
        engine.url + "/v1/completions", content=b'{"prompt": "\xff\xfe"}', headers=headers
    )
    assert bad_utf8.status_code == 400 and _error(bad_utf8)["code"] == "invalid_encoding"
    huge = httpx.post(engine.url + "/v1/completions", content=b"x" * 70000, headers=headers)
    assert huge.status_code == 413 and _error(huge)["code"] == "body_too_large"
    wrong_model = _post(engine, "/v1/completions", {**_completion("a"), "model": "other"})
    assert wrong_model.status_code == 404 and _error(wrong_model)["code"] == "model_not_found"
    bad_tenant = _post(
        engine, "/v1/completions", _completion("a"), headers={"X-Kvguard-Tenant": "bad tenant!"}
    )
    assert bad_tenant.status_code == 400


def test_client_disconnect_mid_stream_frees_pages(engine: EngineProcess) -> None:
    body = _completion("long one", max_tokens=300, stream=True)
    with httpx.stream("POST", engine.url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        for _ in range(4):
            next(lines)
        assert _capacity(engine)["free_pages"] < POOL_TOKENS // PAGE_SIZE
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if _capacity(engine)["free_pages"] == POOL_TOKENS // PAGE_SIZE:
            break
        time.sleep(0.1)
    assert _capacity(engine)["free_pages"] == POOL_TOKENS // PAGE_SIZE


def test_window_larger_than_pool_is_refused_at_start_up(tiny_checkpoint: str) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvguard",
            "backend",
            "unified",
            "--model",
            tiny_checkpoint,
            "--pool-tokens",
            "256",
            "--context-window",
            "1024",
            "--port",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "context window 1024 exceeds the real KV pool of 256 tokens" in result.stderr
    assert "--allow-capacity-drift" in result.stderr


def test_allowed_drift_is_reported_and_requests_stay_within_the_pool(engine_factory: Any) -> None:
    url = engine_factory(pool_tokens=256, context_window=1024, allow_capacity_drift=True)
    cap = httpx.get(url + "/engine/capacity").json()
    assert cap["context_window"] == 1024 and cap["pool_tokens"] == 256
    assert cap["max_request_tokens"] == 256
    assert "exceeds" in cap["drift"]
    metrics = httpx.get(url + "/metrics").text
    assert "kvguard_engine_capacity_drift 1.0" in metrics
    assert 'kvguard_engine_mode{mode="development"} 1.0' in metrics  # scopes the drill alert
    body = {"model": "ignored", "prompt": "z" * 300, "max_tokens": 1}
    body.pop("model")
    over = httpx.post(url + "/v1/completions", json={**body, "model": cap["model"]}, timeout=60)
    assert over.status_code == 400
    assert _error(over)["code"] == "context_length_exceeded"
