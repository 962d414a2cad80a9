"""Helpers for the hostile-input tests: real servers on 127.0.0.1 and a raw-socket client.

``ServedGateway`` runs the gateway app under uvicorn in a background thread, configured by
``gateway.app.server_config`` exactly as ``kvguard gateway`` runs it (the data plane's protocol:
the edge's guarded one, the completion routes below ASGI; body guard), so raw sockets can talk to
it like any hostile client. The engine is a real
``kvguard backend unified`` process (``kvguard.testing.launch_engine``).

``raw_request`` speaks HTTP/1.1 by hand: it can send what no well-behaved client library would
(bare CR/LF in headers, huge heads, bytes dribbled slowly) and reads whatever comes back until
the server closes or the bound passes. A result with ``closed=False`` means the server was still
holding the connection open when the client gave up: the hang the tests forbid.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from canary.config import CanarySettings
from canary.runtime import CanaryRuntime
from contracts.http_edge import EdgeServer
from gateway.app import create_app, server_config
from gateway.config import GatewaySettings

TEST_CANARY_KEY = "hostile-test-canary-key-0123456789abcdef"
ERROR_FIELDS = {"message", "type", "param", "code"}
EDGE_TIMEOUT_S = 1.5  # head and body timeouts of both servers: slow-client tests take seconds
POOL_TOKENS = 512
ENGINE_MODEL = "hostile-tiny"


# -- the gateway under uvicorn, in a thread -------------------------------------------------------


@dataclass
class ServedGateway:
    url: str
    app: Any
    settings: GatewaySettings

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.settings.admin_secret()}"}

    def create_tenant(self, name: str, **fields: Any) -> tuple[str, str]:
        """(tenant id, first key) through the admin API."""
        r = httpx.post(
            self.url + "/admin/tenants", json={"name": name, **fields}, headers=self.admin
        )
        assert r.status_code == 201, r.text
        body = r.json()
        return body["tenant"]["id"], body["key"]["key"]


def gateway_settings(database_url: str, engine_url: str, **overrides: Any) -> GatewaySettings:
    """The gateway's settings for these tests: the real engine, short edge timeouts."""
    values: dict[str, Any] = {
        "database_url": database_url,
        "engines": [{"name": "tiny", "kind": "bundled", "base_url": engine_url}],
        "poll_interval_s": 30.0,
        "capacity_stale_after_s": 60.0,
        "audit_flush_interval_s": 0.05,
        "engine_timeout_s": 5.0,
        "header_timeout_s": EDGE_TIMEOUT_S,
        "body_timeout_s": EDGE_TIMEOUT_S,
        "port": 0,
    }
    values.update(overrides)
    return GatewaySettings(**values)


@contextlib.contextmanager
def serve_in_thread(config: uvicorn.Config) -> Iterator[str]:
    """Run ``config`` in a background thread; yields the base URL; stops it on exit."""
    server = EdgeServer(config)
    thread = threading.Thread(target=server.run, name="hostile-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start (see the log above)")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextlib.contextmanager
def served_gateway(
    settings: GatewaySettings, *, canary: bool = True, **canary_options: Any
) -> Iterator[ServedGateway]:
    """The gateway as ``kvguard gateway`` serves it (with the canary's routes and firewall;
    ``canary_options``: more ``CanarySettings``)."""
    canary_settings = CanarySettings(canary_key=TEST_CANARY_KEY, **canary_options)
    hooks = CanaryRuntime(canary_settings).hooks() if canary else None
    app = create_app(settings, hooks=hooks)
    config = server_config(app, host="127.0.0.1", port=0, lifespan="on")
    with serve_in_thread(config) as url:
        yield ServedGateway(url=url, app=app, settings=settings)


# -- a raw HTTP/1.1 client -----------------------------------------------------------------------


@dataclass
class RawResponse:
    raw: bytes
    closed: bool  # the server closed the connection (False: still open when we gave up)
    sent: int  # bytes of the request the server accepted before answering or closing
    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)

    def error(self) -> dict[str, Any]:
        """The OpenAI-style error of this response (asserting its shape)."""
        assert self.headers.get("content-type", "").startswith("application/json"), self.raw[:300]
        payload = self.json()
        assert set(payload) == {"error"} and set(payload["error"]) == ERROR_FIELDS, payload
        return payload["error"]


def _parse(raw: bytes, closed: bool, sent: int) -> RawResponse:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    response = RawResponse(raw=raw, closed=closed, sent=sent)
    if not lines[0].startswith("HTTP/1.1 "):
        return response
    response.status = int(lines[0].split()[1])
    for line in lines[1:]:
        name, _, value = line.partition(":")
        response.headers[name.strip().lower()] = value.strip()
    length = response.headers.get("content-length")
    response.body = body if length is None else body[: int(length)]
    return response


def _read_until_closed(sock: socket.socket, raw: bytearray, deadline: float) -> bool:
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return False
        except ConnectionResetError:
            return True
        if not chunk:
            return True
        raw += chunk
    return False


def _poll(sock: socket.socket) -> bytes | None:
    """What the server has sent so far without waiting (b"" when it closed, None: nothing)."""
    sock.settimeout(0)
    try:
        return sock.recv(65536)
    except BlockingIOError:
        return None
    except ConnectionResetError:
        return b""


def raw_request(
    url: str,
    chunks: Iterable[bytes],
    *,
    pause_s: float = 0.0,
    wait_s: float = 10.0,
    stop_early: bool = True,
) -> RawResponse:
    """Send ``chunks`` (``pause_s`` apart), stopping early if the server answers or closes
    (``stop_early``; else only if it closes); then read until the server closes the connection,
    for at most ``wait_s`` after the last send."""
    parts = urlsplit(url)
    raw = bytearray()
    sent = 0
    closed = False
    with socket.create_connection((parts.hostname, parts.port), timeout=wait_s) as sock:
        for chunk in chunks:
            early = _poll(sock)
            if early is not None:  # the server answered (or closed) before we finished
                raw += early
                closed = not early
                if closed or stop_early:
                    break
            sock.settimeout(wait_s)
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server closed early; what it answered may still be readable
            sent += len(chunk)
            if pause_s:
                time.sleep(pause_s)
        if not closed:
            closed = _read_until_closed(sock, raw, time.monotonic() + wait_s)
    return _parse(bytes(raw), closed, sent)


def http_head(method: str, path: str, headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def openai_error(response: httpx.Response) -> dict[str, Any]:
    """The OpenAI-style error of an httpx response (asserting its shape)."""
    payload = response.json()
    assert set(payload) == {"error"} and set(payload["error"]) == ERROR_FIELDS, payload
    return payload["error"]


# -- a STAND-IN for an instruction-following model behind a provider ------------------------------

FOLLOWER_MODEL = "follower"


@dataclass
class Follower:
    """A STAND-IN for an instruction-following LLM served by an OpenAI-compatible provider
    (outside our control; shapes as OpenAI's chat completions API). It does what a capable model
    asked to would do: ``repeat: X`` answers X; ``decode base64: X``, ``decode hex: X``,
    ``reverse: X``, ``upper: X`` and ``unspace: X`` undo a disguise; ``join:`` answers every
    user message after it, concatenated in order, spaces removed. Given a ``response_format``
    JSON schema, it answers an object with each of the schema's properties (grammar-constrained
    output writes the property names verbatim). Told to ``leak``, it answers
    with the start of a marker another request carried (``leak_chars``: a damaged copy), as a
    provider that mixes customers up would. It holds no key: every marker it writes is one the
    gateway injected or a client sent."""

    url: str = ""
    leak: bool = False
    leak_chars: int | None = None
    seen: list[dict[str, Any]] = field(default_factory=list)

    def answer(self, body: dict[str, Any]) -> str:
        if self.leak:
            return "Here: " + self.marker_seen()[: self.leak_chars] + " ."
        schema = (body.get("response_format") or {}).get("json_schema", {}).get("schema")
        if schema is not None:
            return json.dumps({name: "x" for name in schema.get("properties", {})})
        users = [str(m.get("content", "")) for m in body.get("messages", []) if m["role"] == "user"]
        if not users:
            return "ok"
        verb, _, arg = users[0].partition(": ")
        if verb == "join:" or users[0] == "join:":
            return "".join(users[1:]).replace(" ", "")
        undo = {
            "repeat": lambda s: s,
            "reverse": lambda s: s[::-1],
            "upper": str.upper,
            "unspace": lambda s: s.replace(" ", ""),
            "decode base64": lambda s: base64.b64decode(s).decode(),
            "decode hex": lambda s: bytes.fromhex(s).decode(),
        }.get(verb)
        return "ok" if undo is None else str(undo(arg))

    def marker_seen(self) -> str:
        """A marker some earlier request carried (the gateway's injected line, say)."""
        for body in self.seen:
            found = re.findall(r"CNRY-[A-Z2-7]{32}", json.dumps(body))
            if found:
                return str(found[0])
        raise AssertionError("the follower has seen no marker")


def follower_app(follower: Follower) -> Any:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": FOLLOWER_MODEL, "object": "model"}]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        follower.seen.append(body)
        text = follower.answer(body)
        message = {"role": "assistant", "content": text}
        usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
        return JSONResponse(
            {
                "id": "chatcmpl-follower",
                "object": "chat.completion",
                "created": 0,
                "model": FOLLOWER_MODEL,
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": usage,
            }
        )

    return app


@contextlib.contextmanager
def served_follower() -> Iterator[Follower]:
    follower = Follower()
    config = uvicorn.Config(follower_app(follower), host="127.0.0.1", port=0, log_level="warning")
    with serve_in_thread(config) as url:
        follower.url = url
        yield follower


def follower_engine(url: str) -> dict[str, Any]:
    """The follower as the gateway's engine: a declared OpenAI-compatible provider."""
    return {
        "name": "follower",
        "kind": "openai",
        "base_url": url,
        "model": FOLLOWER_MODEL,
        "declared_max_model_len": 4096,
        "allow_unverified": True,
    }
