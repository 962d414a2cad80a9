"""Hostile HTTP against the real gateway and the real engine on 127.0.0.1.

Attacker: a client that speaks HTTP badly on purpose, to the gateway with a tenant key (SQLite,
in-process limiter, canary on) and straight to a ``kvguard backend unified`` process, as anything
that reaches an engine's port could (this engine runs without a credential: what is tested here is
its HTTP edge; ``test_hostile_engine_auth`` tests the credential). It tries to tie connections up
(a head or a body dribbled every 0.25 s for 10 s, a connection that sends nothing), to inject or
smuggle (a bare CR or LF, a NUL, Content-Length with Transfer-Encoding, two lengths, a space before
the colon, non-ASCII header bytes), to exhaust memory or the parser (a 256 KiB header, 4,000
headers, a declared 10 GiB body, 256 MiB chunked, JSON nested 100,000 deep, non-UTF-8 bytes, a
million-token prompt), and to fail a whole batch with a temperature whose logits overflow float32.

Proves, on both servers: a slow or silent client gets 408 ``request_timeout`` and a closed
connection once the 1.5 s edge timeouts pass, while honest clients (a head a little slow, a
kept-alive second request, a 300 KB body in one packet) are not cut; oversized heads are 431,
framing and injection attempts 400 ``invalid_http_request``, unreadable header values a plain
refusal (the gateway's 401, the engine's 400); bad bodies get their own 4xx (``invalid_encoding``,
400 for nesting, 413 ``body_too_large`` before a declared body is sent and near the limit of a
chunked one, the engine's memory growing by under 64 MiB, ``context_length_exceeded`` whether
streamed or not); a vanishing temperature samples greedily. Every error is an OpenAI-style body,
never a 500, and after every attack that could wedge a server it still serves a completion.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from hostile_harness import ENGINE_MODEL, http_head, openai_error, raw_request

from kvguard.testing import EngineProcess

MiB = 1 << 20
SLOW_PAUSE_S = 0.25
SLOW_STEPS = 40  # 10 s of dribbling: far past the 1.5 s edge timeouts


@dataclass
class Target:
    name: str
    url: str
    auth: dict[str, str]

    def completion(self, prompt: str, **fields: object) -> dict[str, object]:
        return {
            "model": ENGINE_MODEL,
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            **fields,
        }

    def assert_still_serving(self) -> None:
        r = httpx.post(
            self.url + "/v1/completions",
            json=self.completion("hello"),
            headers=self.auth,
            timeout=60,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1


@pytest.fixture(params=["engine", "gateway"])
def target(request: pytest.FixtureRequest, engine: EngineProcess) -> Iterator[Target]:
    if request.param == "engine":
        yield Target("engine", engine.url, {})
        return
    gateway = request.getfixturevalue("gateway")
    _, key = gateway.create_tenant("hostile")
    yield Target("gateway", gateway.url, {"Authorization": f"Bearer {key}"})


def _post_head(target: Target, **headers: str) -> bytes:
    return http_head(
        "POST", "/v1/completions", {**target.auth, "Content-Type": "application/json", **headers}
    )


# -- slow clients ---------------------------------------------------------------------------------


def test_a_head_dribbled_byte_by_byte_is_cut(target: Target) -> None:
    head = _post_head(target)[:-2]  # never ends
    dribble = [head[: head.index(b"\r\n") + 2]] + [b"X-Slow: a\r\n"] * SLOW_STEPS
    r = raw_request(target.url, dribble, pause_s=SLOW_PAUSE_S)
    assert r.closed, "the server held a slowloris connection open"
    assert r.status == 408 and r.error()["code"] == "request_timeout"
    assert r.sent < sum(map(len, dribble))  # cut before the client finished
    target.assert_still_serving()


def test_a_silent_connection_is_closed(target: Target) -> None:
    r = raw_request(target.url, [], wait_s=10)
    assert r.closed, "the server held an idle connection open"
    assert r.status == 408 and r.error()["code"] == "request_timeout"


def test_a_body_dribbled_byte_by_byte_is_cut(target: Target) -> None:
    body = json.dumps(target.completion("x" * 200)).encode()
    head = _post_head(target, **{"Content-Length": str(len(body))})
    r = raw_request(target.url, [head] + [b" "] * SLOW_STEPS, pause_s=SLOW_PAUSE_S)
    assert r.closed, "the server held a slow-body connection open"
    assert r.status == 408 and r.error()["code"] == "request_timeout"
    target.assert_still_serving()


def test_well_behaved_clients_are_not_cut(target: Target) -> None:
    """The guards must not catch honest clients: a head a little slow but within the timeout, a
    kept-alive connection's second request, a large allowed body sharing a packet with the head."""
    health = http_head("GET", "/health")
    last = http_head("GET", "/health", {"Connection": "close"})
    r = raw_request(target.url, [last[:10], last[10:30], last[30:]], pause_s=0.2)
    assert r.status == 200, r.raw[:300]
    keep_alive = [health, last]
    r = raw_request(target.url, keep_alive, pause_s=0.5, stop_early=False)
    assert r.raw.count(b"HTTP/1.1 200 OK") == 2, r.raw[:500]
    body = json.dumps(target.completion("b" * 300_000)).encode()  # ~300 KB: > the 64 KiB head bound
    head = _post_head(target, **{"Content-Length": str(len(body)), "Connection": "close"})
    r = raw_request(target.url, [head + body])
    assert r.status == 400 and r.error()["code"] == "context_length_exceeded", r.raw[:300]


# -- malformed heads ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra",
    [
        {"X-Big": "a" * (256 * 1024)},
        {f"X-Many-{i}": "b" * 32 for i in range(4000)},
    ],
    ids=["one-huge-header", "many-headers"],
)
def test_oversized_heads_are_431(target: Target, extra: dict[str, str]) -> None:
    r = raw_request(target.url, [_post_head(target, **extra)])
    assert r.closed
    assert r.status == 431 and r.error()["code"] == "headers_too_large"
    target.assert_still_serving()


INJECTIONS = {
    "bare-CR": b"Authorization: Bearer kvg_x\rX-Kvguard-Tenant: victim\r\n",
    "bare-LF": b"Authorization: Bearer kvg_x\nX-Kvguard-Tenant: victim\r\n",
    "NUL": b"Authorization: Bearer kvg_\x00x\r\n",
    "CL+TE smuggling": b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
    "two lengths": b"Content-Length: 4\r\nContent-Length: 40\r\n",
    "space before colon": b"Authorization : Bearer kvg_x\r\n",
}


@pytest.mark.parametrize("line", INJECTIONS.values(), ids=INJECTIONS.keys())
def test_header_injection_and_smuggling_are_400(target: Target, line: bytes) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + line + b"\r\n0\r\n\r\n"
    r = raw_request(target.url, [head])
    assert r.closed
    assert r.status == 400 and r.error()["code"] == "invalid_http_request", r.raw[:300]
    target.assert_still_serving()


def test_non_ascii_header_values_are_refused_cleanly(target: Target) -> None:
    """obs-text bytes reach the app as Latin-1: a key or tenant name that cannot match."""
    if target.name == "gateway":
        head = _post_head(target, Authorization="Bearer kvg_\xff\xfe", **{"Content-Length": "2"})
        expected = (401, "invalid_api_key")
    else:
        head = _post_head(target, **{"X-Kvguard-Tenant": "t\xe9n\xff", "Content-Length": "2"})
        expected = (400, "invalid_request")
    body = json.dumps(target.completion("hi")).encode()
    head = head.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
    head = head.replace(b"Content-Length: 2", f"Content-Length: {len(body)}".encode())
    r = raw_request(target.url, [head + body])
    assert (r.status, r.error()["code"]) == expected


# -- hostile bodies -------------------------------------------------------------------------------


def test_non_utf8_bodies_are_400(target: Target) -> None:
    for raw in (b'{"model": "\xff\xfe", "prompt": "x"}', b"\xc3\x28" * 100):
        r = httpx.post(
            target.url + "/v1/completions",
            content=raw,
            headers={**target.auth, "Content-Type": "application/json"},
            timeout=30,
        )
        assert r.status_code == 400, r.text
        assert openai_error(r)["code"] == "invalid_encoding"


NESTED = {
    "arrays": "[" * 100_000 + "]" * 100_000,
    "objects": '{"a":' * 50_000 + "1" + "}" * 50_000,
    "mixed": '[{"a":' * 30_000 + "1" + "}]" * 30_000,
}


@pytest.mark.parametrize("nested", NESTED.values(), ids=NESTED.keys())
def test_deeply_nested_json_is_400(target: Target, nested: str) -> None:
    for field in ("prompt", "stop", "stream_options"):
        body = f'{{"model": "{ENGINE_MODEL}", "prompt": "x", "{field}": {nested}}}'
        if field == "prompt":
            body = f'{{"model": "{ENGINE_MODEL}", "prompt": {nested}}}'
        r = httpx.post(
            target.url + "/v1/completions",
            content=body.encode(),
            headers={**target.auth, "Content-Type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 400, (field, r.status_code, r.text[:300])
        openai_error(r)
    target.assert_still_serving()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_huge_declared_body_is_refused_before_it_is_sent(target: Target) -> None:
    head = _post_head(target, **{"Content-Length": str(10 << 30)})
    r = raw_request(target.url, [head] + [b"x" * MiB] * 64)
    assert r.status == 413 and r.error()["code"] == "body_too_large"
    assert r.sent < 48 * MiB  # answered long before 10 GiB (loopback buffers hold a few MiB)
    target.assert_still_serving()


def test_a_huge_streamed_body_is_cut_at_the_limit_with_bounded_memory(
    target: Target, engine: EngineProcess
) -> None:
    head = _post_head(target, **{"Transfer-Encoding": "chunked"})
    chunk = f"{MiB:x}\r\n".encode() + b"x" * MiB + b"\r\n"
    rss_before = _rss_bytes(engine.proc.pid)
    r = raw_request(target.url, [head] + [chunk] * 256)
    assert r.status == 413 and r.error()["code"] == "body_too_large"
    assert r.sent < 64 * MiB  # the server stopped reading near its limit, not after 256 MiB
    if target.name == "engine":
        assert _rss_bytes(engine.proc.pid) - rss_before < 64 * MiB
    target.assert_still_serving()


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_a_million_token_prompt_is_context_length_exceeded(target: Target, kind: str) -> None:
    prompt = "a" * 1_000_000  # the byte tokenizer: one token per byte
    if kind == "chat":
        path = "/v1/chat/completions"
        body: dict[str, object] = {
            "model": ENGINE_MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 4,
        }
    else:
        path, body = "/v1/completions", target.completion(prompt)
    for stream in (False, True):
        r = httpx.post(
            target.url + path, json={**body, "stream": stream}, headers=target.auth, timeout=120
        )
        assert r.status_code == 400, r.text[:300]
        error = openai_error(r)
        assert error["code"] == "context_length_exceeded", error
    target.assert_still_serving()


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-40])
def test_a_vanishing_temperature_is_greedy_not_a_failed_step(
    target: Target, temperature: float
) -> None:
    """logits / 1e-300 overflows float32: the engine used to fail the whole step (500 for every
    request in the batch). Below the floor, sampling is its limit: greedy."""
    url = target.url + "/v1/completions"
    greedy = httpx.post(url, json=target.completion("hello", temperature=0), headers=target.auth)
    tiny = httpx.post(
        url, json=target.completion("hello", temperature=temperature), headers=target.auth
    )
    assert tiny.status_code == 200, tiny.text
    assert tiny.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
