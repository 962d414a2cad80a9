"""The proxy path (component tests; upstream: the stand-in engine, a real HTTP server).

Streaming passes the engine's bytes through untouched and as they arrive (the gateway's final
chunk with its kvguard object aside); the gateway adds only what the client asked for; errors
keep OpenAI shapes; the tenant's key never reaches the engine; a response guard can hold back and
cut; a request hook's text is counted; handoff proofs are checked and audited."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from gateway_harness import bearer, running_gateway
from gateway_standin import standin_count
from sqlalchemy import select

from contracts.plugins import Cut, Emit, GatewayHooks, GuardCapabilities, RequestInfo, StreamGuard
from contracts.sql import session_scope
from gateway.app import create_app
from gateway.db.models import RequestAudit
from kvguard.testing import serve

MODEL = "standin-model"
WORDS = "alpha beta gamma delta epsilon"


def _chat(content: str = WORDS, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def _events(raw: bytes) -> list[str]:
    return [e for e in raw.decode().split("\n\n") if e]


def _text(raw: bytes) -> str:
    out = []
    for event in _events(raw):
        data = event.removeprefix("data: ")
        if data == "[DONE]":
            continue
        obj = json.loads(data)
        for choice in obj.get("choices", []):
            out.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(out)


def _final_chunk(r: httpx.Response, passed: bytes, done: bytes) -> dict:
    """The gateway's final chunk of a stream whose other bytes are the engine's, byte for byte:
    the events ``passed``, the final chunk with the gateway's kvguard object, ``done``."""
    assert r.content.startswith(passed) and r.content.endswith(done)
    final = json.loads(r.content[len(passed) : -len(done)].removeprefix(b"data: "))
    assert final["kvguard"] == {
        "request_id": r.headers["x-kvguard-request-id"],
        "isolation": "no_handoff",
        "redactions": 0,
    }
    return final


async def _audit_rows(gw) -> list[RequestAudit]:
    await gw.state.audit.flush()
    with session_scope(gw.state.sessions) as session:
        return list(session.scalars(select(RequestAudit).order_by(RequestAudit.id)))


async def test_stream_bytes_pass_through_untouched(gateway, standin) -> None:
    tenant_id, key = await gateway.create_tenant("acme")
    r = await gateway.client.post(
        "/v1/chat/completions", json=_chat(stream=True, max_tokens=8), headers=bearer(key)
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    sent = standin.controls.sent_chunks
    usage_chunk = [c for c in sent if b'"usage"' in c]
    assert len(usage_chunk) == 1  # the gateway always asks the engine for usage ...
    passed = [c for c in sent if c not in usage_chunk]  # ... not the client
    final = _final_chunk(r, b"".join(passed[:-1]), passed[-1])
    assert final["choices"] == [] and "usage" not in final
    assert _text(r.content) == WORDS

    standin.controls.sent_chunks.clear()
    r = await gateway.client.post(
        "/v1/chat/completions",
        json=_chat(stream=True, max_tokens=8, stream_options={"include_usage": True}),
        headers=bearer(key),
    )
    sent = standin.controls.sent_chunks  # asked for usage: all bytes, the usage chunk last
    final = _final_chunk(r, b"".join(sent[:-2]), sent[-1])
    usage = json.loads(sent[-2].removeprefix(b"data: "))
    assert final == {**usage, "kvguard": final["kvguard"]}
    rows = await _audit_rows(gateway)
    assert [
        (row.outcome, row.prompt_tokens, row.completion_tokens, row.stream) for row in rows
    ] == [("completed", standin_count(messages=[{"content": WORDS}]), 5, True)] * 2


async def test_stream_arrives_chunk_by_chunk(make_settings, standin) -> None:
    standin.controls.chunk_delay_s = 0.15
    settings = make_settings(engines=[{"name": "s", "base_url": standin.url}])
    server = await serve(create_app(settings), lifespan="on")
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
            created = await client.post(
                "/admin/tenants", json={"name": "acme"}, headers=bearer(settings.admin_secret())
            )
            key = created.json()["key"]["key"]
            started = time.perf_counter()
            arrivals = []
            async with client.stream(
                "POST",
                "/v1/completions",
                headers=bearer(key),
                json={
                    "model": MODEL,
                    "prompt": WORDS,
                    "max_tokens": 5,
                    "stream": True,
                },
            ) as response:
                async for chunk in response.aiter_raw():
                    arrivals.append((time.perf_counter() - started, chunk))
    finally:
        await server.stop()
    total = arrivals[-1][0]
    assert total >= 0.7  # five words, 0.15 s apart
    assert arrivals[0][0] < 0.3  # the first word came long before the last was written
    assert len(arrivals) >= 5


async def test_headers_to_the_engine_and_no_tenant_key(gateway, standin) -> None:
    tenant_id, key = await gateway.create_tenant("acme")
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    r = await gateway.client.post(
        "/v1/completions",
        headers={**bearer(key), "traceparent": parent},
        json={"model": MODEL, "prompt": WORDS, "max_tokens": 3},
    )
    assert r.status_code == 200
    seen = standin.controls.seen_headers[-1]
    assert seen["x-kvguard-tenant"] == tenant_id
    assert seen["x-kvguard-request-id"] == r.headers["x-kvguard-request-id"]
    # The gateway's own trace reaches the engine, never the client's (gateway.tracing), sampled
    # with real ids even though this gateway exports no spans (they are non-recording here).
    assert gateway.state.tracing.exporting is False
    version, trace_id, span_id, flags = seen["traceparent"].split("-")
    assert trace_id not in ("0af7651916cd43dd8448eb211c80319c", "0" * 32)
    assert (version, flags, len(span_id)) == ("00", "01", 16) and span_id != "0" * 16
    assert "authorization" not in seen and key not in json.dumps(seen)
    body = standin.controls.seen_bodies[-1]
    assert body == {"model": MODEL, "prompt": WORDS, "max_tokens": 3}
    default = await gateway.client.post(
        "/v1/completions",
        headers=bearer(key),
        json={"model": MODEL, "prompt": WORDS, "stream": True},
    )
    assert default.status_code == 200
    assert standin.controls.seen_bodies[-1] == {
        "model": MODEL,
        "prompt": WORDS,
        "stream": True,
        "max_tokens": 4096 - standin_count(WORDS),  # without max_tokens: as much as fits
        "stream_options": {"include_usage": True},
    }


async def test_engine_errors_keep_their_meaning(gateway, standin) -> None:
    _, key = await gateway.create_tenant("acme")
    standin.controls.refuse_above = 10  # the engine refuses what its capacity report allowed
    for stream in (False, True):
        r = await gateway.client.post(
            "/v1/completions",
            headers=bearer(key),
            json={"model": MODEL, "prompt": WORDS, "max_tokens": 8, "stream": stream},
        )
        assert r.status_code == 400
        assert r.json()["error"] == {
            "message": "prompt too long for this engine",
            "type": "invalid_request_error",
            "param": None,
            "code": "context_length_exceeded",
        }
    standin.controls.refuse_above = None
    standin.controls.omit_done = True  # a stream that just stops is not a success
    r = await gateway.client.post(
        "/v1/completions",
        headers=bearer(key),
        json={"model": MODEL, "prompt": WORDS, "max_tokens": 8, "stream": True},
    )
    last = json.loads(_events(r.content)[-1].removeprefix("data: "))
    assert last["error"]["code"] == "upstream_error"
    rows = await _audit_rows(gateway)
    assert [(row.outcome, row.http_status, row.error_code) for row in rows] == [
        ("rejected", 400, "context_length_exceeded"),
        ("rejected", 400, "context_length_exceeded"),
        ("failed", 502, "upstream_error"),
    ]


async def test_connection_error_is_502(make_settings, standin) -> None:
    spec = {
        "name": "o",
        "kind": "openai",
        "base_url": standin.url,
        "model": "hosted",
        "declared_max_model_len": 1000,
        "allow_unverified": True,
    }
    async with running_gateway(make_settings(engines=[spec])) as gw:
        _, key = await gw.create_tenant("acme")
        await standin.stop()
        for stream in (False, True):
            r = await gw.client.post(
                "/v1/completions",
                headers=bearer(key),
                json={"model": "hosted", "prompt": "hi", "max_tokens": 2, "stream": stream},
            )
            assert (r.status_code, r.json()["error"]["code"]) == (502, "upstream_error")


async def test_silent_engine_times_out_as_502(make_settings, standin) -> None:
    """An engine that stops answering costs a client the read timeout, then a clear error:
    a 502 before the stream opens, an error event (not a hang) when it stalls mid-stream."""
    settings = make_settings(
        engines=[{"name": "s", "kind": "bundled", "base_url": standin.url}],
        upstream_read_timeout_s=0.5,
    )
    async with running_gateway(settings) as gw:
        _, key = await gw.create_tenant("acme")
        gate = standin.controls.gate = asyncio.Event()  # the engine does not answer until set
        for stream in (False, True):
            started = time.perf_counter()
            r = await gw.client.post(
                "/v1/completions",
                headers=bearer(key),
                json={"model": MODEL, "prompt": WORDS, "max_tokens": 5, "stream": stream},
            )
            assert (r.status_code, r.json()["error"]["code"]) == (502, "upstream_error")
            assert time.perf_counter() - started < 5
        gate.set()  # let the two waiting handlers end (their client is gone)
        standin.controls.gate = None
        standin.controls.chunk_delay_s = 2.0  # first word, then silence past the timeout
        started = time.perf_counter()
        r = await gw.client.post(
            "/v1/completions",
            headers=bearer(key),
            json={"model": MODEL, "prompt": WORDS, "max_tokens": 5, "stream": True},
        )
        assert time.perf_counter() - started < 1.8
        assert r.status_code == 200
        assert _text(r.content) == "alpha"
        assert r.text.rstrip().endswith('"code":"upstream_error"}}')
        rows = await _audit_rows(gw)
        assert [(a.stream, a.outcome, a.error_code) for a in rows] == [
            (False, "failed", "upstream_error"),
            (True, "failed", "upstream_error"),
            (True, "failed", "upstream_error"),  # the stall mid-stream
        ]


class CutOn(StreamGuard):
    """A test guard: holds back len(word)-1 characters; cuts when the word completes."""

    def __init__(self, word: str) -> None:
        self.word, self.held = word, ""

    def feed(self, text: str) -> Emit | Cut:
        self.held += text
        if self.word in self.held:
            return Cut(code="isolation_violation", message="response stopped by the canary")
        keep = len(self.word) - 1
        out, self.held = self.held[:-keep], self.held[-keep:]
        return Emit(out)

    def finish(self) -> Emit | Cut:
        out, self.held = self.held, ""
        return Emit(out)


class Guards:
    capabilities = GuardCapabilities()  # screens the side fields too, with no prefilter

    def __init__(self, word: str) -> None:
        self.word = word
        self.cuts: list[tuple[RequestInfo, Cut]] = []

    def open(self, info: RequestInfo) -> CutOn:
        return CutOn(self.word)

    async def on_cut(self, info: RequestInfo, cut: Cut) -> None:
        self.cuts.append((info, cut))


class AppendWords:
    async def prepare(self, info: RequestInfo, body: dict) -> dict:
        return {**body, "prompt": body["prompt"] + " injected marker"}


async def test_guard_holds_back_and_cuts(make_settings, standin) -> None:
    guards = Guards("SECRET")
    hooks = GatewayHooks(guards=guards, on_cut=guards.on_cut)
    settings = make_settings(engines=[{"name": "s", "base_url": standin.url}])
    async with running_gateway(settings, hooks=hooks) as gw:
        tenant_id, key = await gw.create_tenant("acme")
        clean = await gw.client.post(
            "/v1/chat/completions", headers=bearer(key), json=_chat(stream=True, max_tokens=8)
        )
        assert _text(clean.content) == WORDS and clean.content.endswith(b"data: [DONE]\n\n")
        leaky = _chat("one two SECRET three", stream=True, max_tokens=8)
        r = await gw.client.post("/v1/chat/completions", headers=bearer(key), json=leaky)
        assert b"SECRET" not in r.content and b"[DONE]" not in r.content
        assert _text(r.content) == "on"  # the held-back "e two" never left
        assert json.loads(_events(r.content)[-1].removeprefix("data: "))["error"]["code"] == (
            "isolation_violation"
        )
        flat = await gw.client.post(
            "/v1/chat/completions",
            headers=bearer(key),
            json=_chat("one two SECRET three", max_tokens=8),
        )
        assert (flat.status_code, flat.json()["error"]["code"]) == (502, "isolation_violation")
        assert "SECRET" not in flat.text
        rows = await _audit_rows(gw)
    assert [row.outcome for row in rows] == ["completed", "cut", "cut"]
    assert [(info.tenant_id, info.engine, cut.code) for info, cut in guards.cuts] == [
        (tenant_id, "s", "isolation_violation")
    ] * 2


async def test_request_hook_text_is_counted(make_settings, standin) -> None:
    hooks = GatewayHooks(request_hooks=[AppendWords()])
    settings = make_settings(engines=[{"name": "s", "base_url": standin.url}])
    async with running_gateway(settings, hooks=hooks) as gw:
        _, key = await gw.create_tenant("acme", max_context_tokens=10)
        ok = await gw.client.post(
            "/v1/completions",
            headers=bearer(key),
            json={"model": MODEL, "prompt": "a b c d", "max_tokens": 4},
        )
        assert ok.status_code == 200  # 4 + 2 injected + 4 = 10
        assert standin.controls.seen_bodies[-1]["prompt"] == "a b c d injected marker"
        # 5 + 2 + 4 = 11 does not fit, 5 + 4 = 9 does: the hook's text is dropped, never the
        # reason for a refusal.
        plain = await gw.client.post(
            "/v1/completions",
            headers=bearer(key),
            json={"model": MODEL, "prompt": "a b c d e", "max_tokens": 4},
        )
        assert plain.status_code == 200 and plain.json()["usage"]["prompt_tokens"] == 5
        assert standin.controls.seen_bodies[-1]["prompt"] == "a b c d e"
        over = await gw.client.post(
            "/v1/completions",
            headers=bearer(key),
            json={"model": MODEL, "prompt": "a b c d e f g", "max_tokens": 4},
        )
        assert over.status_code == 400
        assert "7 in the prompt" in over.json()["error"]["message"]  # the client's own size


async def test_handoff_proof_checked_and_audited(gateway, standin) -> None:
    _, key = await gateway.create_tenant("acme")
    standin.controls.handoff = {"outcome": "ok", "reserved_tokens": 12, "transferred_tokens": 12}
    ok = await gateway.client.post(
        "/v1/completions",
        headers=bearer(key),
        json={"model": MODEL, "prompt": WORDS, "max_tokens": 3},
    )
    assert ok.status_code == 200
    standin.controls.handoff = {"outcome": "ok", "reserved_tokens": 12, "transferred_tokens": 1}
    bad = await gateway.client.post(
        "/v1/completions",
        headers=bearer(key),
        json={"model": MODEL, "prompt": WORDS, "max_tokens": 3},
    )
    assert (bad.status_code, bad.json()["error"]["code"]) == (502, "handoff_mismatch")
    assert "alpha" not in bad.text
    streamed = await gateway.client.post(
        "/v1/completions",
        headers=bearer(key),
        json={"model": MODEL, "prompt": WORDS, "max_tokens": 3, "stream": True},
    )
    last = json.loads(_events(streamed.content)[-1].removeprefix("data: "))
    assert last["error"]["code"] == "handoff_mismatch" and b"[DONE]" not in streamed.content
    rows = await _audit_rows(gateway)
    assert [
        (r.outcome, r.error_code, r.handoff_outcome, r.reserved_tokens, r.transferred_tokens)
        for r in rows
    ] == [
        ("completed", None, "ok", 12, 12),
        ("failed", "handoff_mismatch", "ok", 12, 1),
        ("failed", "handoff_mismatch", "ok", 12, 1),
    ]
    metrics = (await gateway.client.get("/metrics")).text
    assert 'kvguard_gateway_handoff_mismatch_total{engine="standin"} 2.0' in metrics
