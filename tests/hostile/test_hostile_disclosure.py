"""Nothing a tenant reads names an engine, and an answer the firewall changed says so.

Attacker: a tenant who reads every error and header for the serving path behind the gateway --
which engine, at which address, which of its isolation checks are off -- to aim at it (issue 32,
finding 5: ``'response_format' is not supported by engine '127.0.0.1:49211'``; every answer's
``kvguard`` object listed the engine's skipped checks). And a tenant whose answer arrives emptied
(its own marker stripped: usage counting completion tokens, no content) with nothing saying why.

Setup: the gateway as ``kvguard gateway`` serves it (uvicorn on 127.0.0.1, the canary on),
routing one model to the real engine (a ``kvguard backend unified`` process) and others to
STAND-INS for OpenAI-compatible providers outside our control: real HTTP servers following the
shapes of OpenAI's API (``/work/shared/reference/openai-openapi.yaml``: chat completions, SSE
chunks, the error object) that misbehave on demand -- HTTP 500, 400 and 429 whose messages hold
internal addresses, malformed answers, an error event mid-stream, a dropped stream, an answer
slower than the gateway's read timeout, and the ``kvguard`` extension the bundled engine adds
(a handoff proof with its checks and skipped checks; a mismatched one). One provider is stopped
after the gateway saw it alive (down at request time), one never listened at all. The engines'
names are distinctive strings, so any of them in a body or header is a disclosure.

Proves: over every error path the stack can be driven to (the feature refusal, the context refusal,
a quarantined engine, an unreachable one, a dead one, 5xx, 4xx, 429, malformed, a handoff mismatch,
a timeout, stream errors and breaks), no tenant-visible body or header holds an engine's name, its
host:port, an address an engine wrote in its own message, or its checks; each path is asserted to
be the path it names (status and code); a cut answer names none either. The log keeps the engine's
name and address with the request id. A 200's ``kvguard`` object is the gateway's (request id,
isolation verdict, redactions), on whole answers and in a stream's final chunk. An answer emptied
by the firewall (the tenant's own marker, a literal look-alike) says ``redactions: 1`` in its
``kvguard`` object and ``x-kvguard-redactions`` header (a stream: in its final chunk), the same for
both kinds of candidate.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from hostile_harness import ENGINE_MODEL, ServedGateway, gateway_settings, serve_in_thread
from hostile_harness import served_gateway as served

from contracts.engine import HandoffProof
from kvguard.localservices import free_port
from kvguard.testing import EngineProcess

PROVIDER_MODEL = "provider-model"
FLAKY_MODEL = "flaky-model"
DEAD_MODEL = "dead-model"
READ_TIMEOUT_S = 2.0  # the gateway's wait for an engine's next bytes
PLANTED = ("10.9.8.7", "internal.provider.example")  # addresses a provider writes in messages
MARKER_RE = re.compile(r"CNRY-[A-Z2-7]{32}")
LOOK_ALIKE = "CNRY-" + "A" * 32  # a literal candidate whose MAC does not verify
NAMES = {
    "bundled": "eng-bundled-7f3a",
    "provider": "eng-provider-91c2",
    "flaky": "eng-flaky-44d0",
    "dead": "eng-dead-0b6e",
}


def _proof(transferred: int) -> dict[str, Any]:
    return HandoffProof(
        protocol_version=3,
        outcome="ok",
        reserved_tokens=12,
        transferred_tokens=transferred,
        checks=("transfer_range", "page_generations"),
        skipped_checks=("checksum", "seal"),
    ).as_dict()


def _extension(mode: str) -> dict[str, Any]:
    return {"kvguard": {"role": "decode", "handoff": _proof(1 if mode == "mismatch" else 12)}}


@dataclass
class ProviderState:
    mode: str = "ok"
    seen: list[dict[str, Any]] = field(default_factory=list)

    def answer_text(self, body: dict[str, Any]) -> str:
        own = MARKER_RE.findall(json.dumps(body))
        if self.mode == "own_marker":
            assert own, "the gateway injected no marker"
            return own[0]
        if self.mode == "foreign_marker":  # another request's marker: the leak the canary cuts
            earlier = [m for b in self.seen[:-1] for m in MARKER_RE.findall(json.dumps(b))]
            return f"Sure: {next(m for m in earlier if m not in own)}"
        return LOOK_ALIKE if self.mode == "look_alike" else "hello there"


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
    return {
        "id": "chatcmpl-p",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": PROVIDER_MODEL,
        "choices": [choice],
    }


def _sse(obj: Any) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


def provider_app(state: ProviderState) -> FastAPI:
    """A STAND-IN for a third-party OpenAI-compatible provider (see the module docstring)."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": PROVIDER_MODEL, "object": "model"}]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        state.seen.append(body)
        mode = state.mode
        if mode == "slow":
            await asyncio.sleep(READ_TIMEOUT_S + 1.0)
        if mode == "500":
            error = {"message": "worker http://10.9.8.7:8000/v1 crashed", "type": "server_error"}
            return JSONResponse({"error": error}, status_code=500)
        if mode == "400":
            message = "bad request: see http://internal.provider.example:9000/docs (10.9.8.7:8000)"
            error = {"message": message, "type": "invalid_request_error", "code": "bad_request"}
            return JSONResponse({"error": {**error, "param": None}, **_extension(mode)}, 400)
        if mode == "429":
            return JSONResponse({"error": {"message": "slow down, 10.9.8.7:8000 is busy"}}, 429)
        if mode == "malformed":
            return PlainTextResponse("<html>upstream 10.9.8.7:8000 says hi</html>")
        text = state.answer_text(body)
        usage = {"prompt_tokens": 9, "completion_tokens": 38, "total_tokens": 47}
        if body.get("stream"):
            return StreamingResponse(_events(mode, text, usage), media_type="text/event-stream")
        message = {"role": "assistant", "content": text, "refusal": None}
        choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
        answer = {"id": "chatcmpl-p", "object": "chat.completion", "created": 1}
        answer.update({"model": PROVIDER_MODEL, "choices": [choice], "usage": usage})
        return JSONResponse({**answer, **_extension(mode)})

    async def _events(mode: str, text: str, usage: dict[str, int]) -> Any:
        yield _sse(_chunk({"role": "assistant", "content": ""}))
        yield _sse(_chunk({"content": text}))
        if mode == "stream_error":
            error = {"message": "lost worker 10.9.8.7:8000", "type": "server_error", "code": "gone"}
            yield _sse({"error": error, **_extension(mode)})
            return
        if mode == "stream_break":
            raise RuntimeError("the provider drops the connection")
        if mode == "stream_garbage":
            yield b"data: {not json at 10.9.8.7:8000\n\n"
            return
        yield _sse({**_chunk({}, "stop"), **_extension(mode)})
        yield _sse({**_chunk({}), "choices": [], "usage": usage, **_extension(mode)})
        yield _sse("[DONE]")

    return app


@dataclass
class Stack:
    gateway: ServedGateway
    provider: ProviderState
    key: str
    addresses: dict[str, str]  # engine -> host:port

    @property
    def secrets(self) -> tuple[str, ...]:
        return (*NAMES.values(), *self.addresses.values(), *PLANTED)


def _engines(engine_url: str, provider: str, flaky: str, dead: str) -> list[dict[str, Any]]:
    def declared(name: str, url: str, model: str) -> dict[str, Any]:
        return {
            "name": NAMES[name],
            "kind": "openai",
            "base_url": url,
            "model": model,
            "declared_max_model_len": 8192,
            "allow_unverified": True,
        }

    return [
        {"name": NAMES["bundled"], "kind": "bundled", "base_url": engine_url},
        declared("provider", provider, PROVIDER_MODEL),
        declared("flaky", flaky, FLAKY_MODEL),
        declared("dead", dead, DEAD_MODEL),
    ]


def _server(app: FastAPI) -> Any:
    return serve_in_thread(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))


@pytest.fixture(scope="module")
def stack(engine: EngineProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    state = ProviderState()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing ever listens there
    database = f"sqlite:///{tmp_path_factory.mktemp('disclosure')}/kvguard.db"
    with _server(provider_app(state)) as provider:
        flaky_server = _server(provider_app(ProviderState()))
        flaky = flaky_server.__enter__()
        engines = _engines(engine.url, provider, flaky, dead)
        settings = gateway_settings(
            database, engine.url, engines=engines, upstream_read_timeout_s=READ_TIMEOUT_S
        )
        try:
            with served(settings) as gateway:
                flaky_server.__exit__(None, None, None)  # seen alive at start, down from now on
                flaky_server = None
                _, key = gateway.create_tenant("reader", canary_sample_rate=1.0)
                urls = [engine.url, provider, flaky, dead]
                addresses = {
                    n: u.split("://", 1)[1].rstrip("/") for n, u in zip(NAMES, urls, strict=True)
                }
                yield Stack(gateway, state, key, addresses)
        finally:
            if flaky_server is not None:
                flaky_server.__exit__(None, None, None)


def _post(stack: Stack, body: dict[str, Any], *, path: str = "/v1/chat/completions") -> Any:
    return httpx.post(
        stack.gateway.url + path,
        json=body,
        headers={"Authorization": f"Bearer {stack.key}"},
        timeout=60,
    )


def _chat(model: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 2,
        **extra,
    }


def assert_discloses_nothing(stack: Stack, r: httpx.Response) -> None:
    seen = [r.text, *(f"{name}: {value}" for name, value in r.headers.items())]
    for text in seen:
        for secret in stack.secrets:
            assert secret not in text, (secret, text)
        assert "skipped_checks" not in text and "transfer_range" not in text, text
    assert "x-kvguard-engine" not in r.headers


def _error(r: httpx.Response) -> dict[str, Any]:
    """The error of a refusal, or of the error event that ended a stream."""
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        errors = [e["error"] for e in _events(r) if "error" in e]
        assert len(errors) == 1, r.text
        return errors[0]
    return r.json()["error"]


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    blocks = [b[6:] for b in r.text.split("\n\n") if b.startswith("data: ")]
    return [json.loads(b) for b in blocks if b != "[DONE]"]


# (name, model, provider mode, extra body fields, expected status, expected code)
ERROR_PATHS = [
    ("feature", ENGINE_MODEL, "ok", {"reasoning_effort": "low"}, 400,
     "unsupported_parameter"),
    ("context", ENGINE_MODEL, "ok", {"messages": [{"role": "user", "content": "x " * 600}]}, 400,
     "context_length_exceeded"),
    ("dead engine", DEAD_MODEL, "ok", {}, 503, "no_healthy_engine"),
    ("engine gone", FLAKY_MODEL, "ok", {}, 502, "upstream_error"),
    ("5xx", PROVIDER_MODEL, "500", {}, 502, "upstream_error"),
    ("4xx", PROVIDER_MODEL, "400", {}, 400, "bad_request"),
    ("429", PROVIDER_MODEL, "429", {}, 503, "engine_overloaded"),
    ("malformed", PROVIDER_MODEL, "malformed", {}, 502, "upstream_error"),
    ("handoff mismatch", PROVIDER_MODEL, "mismatch", {}, 502, "handoff_mismatch"),
    ("timeout", PROVIDER_MODEL, "slow", {}, 502, "upstream_error"),
    ("stream 5xx", PROVIDER_MODEL, "500", {"stream": True}, 502, "upstream_error"),
    ("stream 4xx", PROVIDER_MODEL, "400", {"stream": True}, 400, "bad_request"),
    ("stream error event", PROVIDER_MODEL, "stream_error", {"stream": True}, 200, "gone"),
    ("stream break", PROVIDER_MODEL, "stream_break", {"stream": True}, 200, "upstream_error"),
    ("stream garbage", PROVIDER_MODEL, "stream_garbage", {"stream": True}, 200, "upstream_error"),
    ("stream mismatch", PROVIDER_MODEL, "mismatch", {"stream": True}, 200, "handoff_mismatch"),
    ("stream gone", FLAKY_MODEL, "ok", {"stream": True}, 502, "upstream_error"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("model", "mode", "extra", "status", "code"),
    [p[1:] for p in ERROR_PATHS],
    ids=[p[0] for p in ERROR_PATHS],
)
def test_no_error_path_names_an_engine(
    stack: Stack, model: str, mode: str, extra: dict[str, Any], status: int, code: str
) -> None:
    stack.provider.mode = mode
    r = _post(stack, _chat(model, **extra))
    assert r.status_code == status, r.text
    error = _error(r)
    assert error["code"] == code, r.text
    assert_discloses_nothing(stack, r)
    if mode in ("400", "stream_error"):  # the provider's own words, its addresses taken out
        assert "<internal>" in error["message"], error


def test_a_quarantined_engine_is_not_named(stack: Stack) -> None:
    gw = stack.gateway
    name = NAMES["bundled"]
    reason = f"copies markers (seen on {stack.addresses['bundled']})"
    r = httpx.post(f"{gw.url}/admin/engines/{name}/quarantine", json={"reason": reason},
                   headers=gw.admin)  # fmt: skip
    assert r.status_code == 200, r.text
    try:
        r = _post(stack, _chat(ENGINE_MODEL))
        assert r.status_code == 503 and _error(r)["code"] == "no_healthy_engine", r.text
        assert_discloses_nothing(stack, r)
        assert "copies markers" not in r.text
    finally:
        httpx.request("DELETE", f"{gw.url}/admin/engines/{name}/quarantine", headers=gw.admin)


def test_a_cut_answer_names_no_engine(stack: Stack) -> None:
    """Another tenant's marker in the answer: the firewall cuts it (and the canary quarantines
    the provider); the cut says so without naming the engine."""
    gw = stack.gateway
    stack.provider.mode = "ok"
    assert _post(stack, _chat(PROVIDER_MODEL)).status_code == 200  # the provider sees a marker
    _, other = gw.create_tenant("neighbour", canary_sample_rate=1.0)
    stack.provider.mode = "foreign_marker"
    try:
        r = httpx.post(
            gw.url + "/v1/chat/completions",
            json=_chat(PROVIDER_MODEL),
            headers={"Authorization": f"Bearer {other}"},
            timeout=60,
        )
        assert r.status_code == 502 and _error(r)["code"] == "isolation_violation", r.text
        assert_discloses_nothing(stack, r)
    finally:
        stack.provider.mode = "ok"
        name = NAMES["provider"]
        httpx.request("DELETE", f"{gw.url}/admin/engines/{name}/quarantine", headers=gw.admin)


def test_the_log_names_the_engine_by_request_id(
    stack: Stack, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="kvguard.gateway")
    r = _post(stack, _chat(FLAKY_MODEL))
    assert r.status_code == 502, r.text
    request_id = r.headers["x-kvguard-request-id"]
    flaky_address = stack.addresses["flaky"]
    lines = [rec.getMessage() for rec in caplog.records if request_id in rec.getMessage()]
    assert any(NAMES["flaky"] in line and flaky_address in line for line in lines), lines


@pytest.mark.parametrize("model", [ENGINE_MODEL, PROVIDER_MODEL])
@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_carries_the_gateways_kvguard_object(
    stack: Stack, model: str, stream: bool
) -> None:
    """The engine's object (role, proof, checks) stays behind; the tenant gets its request id,
    the isolation verdict (the provider's proof holds: verified; the unified engine has no
    handoff) and the redaction count."""
    stack.provider.mode = "ok"
    r = _post(stack, _chat(model, stream=stream))
    assert r.status_code == 200, r.text
    assert_discloses_nothing(stack, r)
    isolation = "handoff_verified" if model == PROVIDER_MODEL else "no_handoff"
    expected = {
        "request_id": r.headers["x-kvguard-request-id"],
        "isolation": isolation,
        "redactions": 0,
    }
    if stream:
        events = _events(r)
        assert events[-1]["kvguard"] == expected and events[-1]["choices"] == []
        assert all("kvguard" not in e for e in events[:-1]), events
    else:
        assert r.json()["kvguard"] == expected
        assert r.headers["x-kvguard-redactions"] == "0"


@pytest.mark.parametrize("mode", ["own_marker", "look_alike"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_emptied_by_the_firewall_says_so(stack: Stack, mode: str, stream: bool) -> None:
    """The provider answers with nothing but the tenant's own injected marker, or a literal
    look-alike: the firewall strips it, and the answer -- empty, its usage still counting the
    completion tokens -- carries ``redactions: 1``, the same for both kinds."""
    stack.provider.mode = mode
    body = _chat(PROVIDER_MODEL, stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = _post(stack, body)
    assert r.status_code == 200, r.text
    assert "CNRY" not in r.text
    if stream:
        events = _events(r)
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        final = events[-1]
        assert final["usage"]["completion_tokens"] == 38
        assert "x-kvguard-redactions" not in r.headers  # sent before the count was known
    else:
        final = r.json()
        text = final["choices"][0]["message"]["content"]
        assert r.headers["x-kvguard-redactions"] == "1"
    assert text == ""
    assert final["usage"]["completion_tokens"] == 38
    assert final["kvguard"]["redactions"] == 1, final


@pytest.mark.parametrize("mode", ["own_marker", "look_alike"])
def test_a_responses_answer_emptied_by_the_firewall_says_so(stack: Stack, mode: str) -> None:
    """The same through the Responses API (translated through chat for this provider): the
    Response's text is empty, its usage counts the output tokens, and the header says 1."""
    stack.provider.mode = mode
    body = {"model": PROVIDER_MODEL, "input": "hi", "max_output_tokens": 16}
    r = _post(stack, body, path="/v1/responses")
    assert r.status_code == 200, r.text
    assert "CNRY" not in r.text
    answer = r.json()
    [message] = [item for item in answer["output"] if item["type"] == "message"]
    assert "".join(part["text"] for part in message["content"]) == ""
    assert answer["usage"]["output_tokens"] == 38
    assert r.headers["x-kvguard-redactions"] == "1"
    assert_discloses_nothing(stack, r)


# The same paths through the Responses API (translated through chat for these engines): a refusal
# before the stream is the same error body; a stream ends in an ``error`` event and
# ``response.failed``, whose texts name no engine either.
RESPONSES_PATHS = [
    ("context", ENGINE_MODEL, "ok", {"input": "x " * 600}, 400, "context_length_exceeded"),
    ("dead engine", DEAD_MODEL, "ok", {}, 503, "no_healthy_engine"),
    ("engine gone", FLAKY_MODEL, "ok", {}, 502, "upstream_error"),
    ("5xx", PROVIDER_MODEL, "500", {}, 502, "upstream_error"),
    ("4xx", PROVIDER_MODEL, "400", {}, 400, "bad_request"),
    ("malformed", PROVIDER_MODEL, "malformed", {}, 502, "upstream_error"),
    ("handoff mismatch", PROVIDER_MODEL, "mismatch", {}, 502, "handoff_mismatch"),
    ("timeout", PROVIDER_MODEL, "slow", {}, 502, "upstream_error"),
    ("stream error event", PROVIDER_MODEL, "stream_error", {"stream": True}, 200, "gone"),
    ("stream break", PROVIDER_MODEL, "stream_break", {"stream": True}, 200, "upstream_error"),
    ("stream garbage", PROVIDER_MODEL, "stream_garbage", {"stream": True}, 200, "upstream_error"),
    ("stream mismatch", PROVIDER_MODEL, "mismatch", {"stream": True}, 200, "handoff_mismatch"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("model", "mode", "extra", "status", "code"),
    [p[1:] for p in RESPONSES_PATHS],
    ids=[p[0] for p in RESPONSES_PATHS],
)
def test_no_responses_error_path_names_an_engine(
    stack: Stack, model: str, mode: str, extra: dict[str, Any], status: int, code: str
) -> None:
    stack.provider.mode = mode
    body = {"model": model, "input": "hi", "max_output_tokens": 16, **extra}
    r = _post(stack, body, path="/v1/responses")
    assert r.status_code == status, r.text
    if status == 200:
        events = [
            json.loads(b.split("data: ", 1)[1]) for b in r.text.split("\n\n") if "data: " in b
        ]
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"], r.text
        assert events[-2]["code"] == code, r.text
    else:
        assert r.json()["error"]["code"] == code, r.text
    assert_discloses_nothing(stack, r)
