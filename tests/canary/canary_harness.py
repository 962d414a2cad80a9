"""Helpers for canary tests: a gateway with the canary served over real HTTP on 127.0.0.1, and a
STAND-IN for a *compromised third-party provider*.

``CompromisedProvider`` is a real HTTP server speaking the OpenAI-compatible API, registered in
the gateway as a generic ``openai`` engine (declared capacity). It models something outside our
control: a hosted provider whose serving stack mixes customers up. It remembers every prompt it
was sent, and when told to leak it answers one tenant with text copied from another tenant's
earlier prompt (which holds that tenant's injected marker), split into the chunks a test asks
for. It holds no canary key and forges nothing: every marker it emits is one the gateway itself
injected into a real request. It is NOT the kvguard engine; tests of the bundled engine use
``engine_factory``.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from canary.config import CanarySettings
from canary.runtime import CanaryRuntime
from gateway.app import create_app
from gateway.config import GatewaySettings
from gateway.state import GatewayState
from kvguard.testing import RunningServer, serve

PROVIDER_MODEL = "provider-model"
TEST_CANARY_KEY = "canary-test-key-0123456789abcdef0123456789"
MARKER_RE = re.compile(r"CNRY-[A-Z2-7]{32}")


# -- the gateway with the canary ------------------------------------------------------------------


@dataclass
class CanaryGateway:
    url: str
    client: httpx.AsyncClient
    runtime: CanaryRuntime
    app: Any

    @property
    def state(self) -> GatewayState:
        return self.app.state.gateway

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.state.settings.admin_secret()}"}

    async def create_tenant(self, name: str, **fields: Any) -> tuple[str, str]:
        r = await self.client.post(
            "/admin/tenants", json={"name": name, **fields}, headers=self.admin
        )
        assert r.status_code == 201, r.text
        body = r.json()
        return body["tenant"]["id"], body["key"]["key"]

    async def findings(self, **params: Any) -> list[dict[str, Any]]:
        r = await self.client.get("/admin/canary/findings", params=params, headers=self.admin)
        assert r.status_code == 200, r.text
        return r.json()

    async def metrics(self) -> str:
        return (await self.client.get("/metrics")).text


@contextlib.asynccontextmanager
async def canary_gateway(
    settings: GatewaySettings,
    canary: CanarySettings,
    *,
    random: Callable[[], float] | None = None,
) -> AsyncIterator[CanaryGateway]:
    runtime = CanaryRuntime(canary, random=random)
    app = create_app(settings, hooks=runtime.hooks())
    server = await serve(app, lifespan="on")
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            yield CanaryGateway(url=server.url, client=client, runtime=runtime, app=app)
    finally:
        await server.stop()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def provider_engine(url: str, name: str = "thirdparty") -> dict[str, Any]:
    return {
        "name": name,
        "kind": "openai",
        "base_url": url,
        "model": PROVIDER_MODEL,
        "declared_max_model_len": 8192,
        "allow_unverified": True,
    }


def sse_text(raw: bytes) -> tuple[str, list[dict[str, Any]]]:
    """(the text a client assembles from every choice, the error objects) of an SSE body."""
    text, errors = [], []
    for block in raw.decode().split("\n\n"):
        data = "\n".join(
            line[5:].strip() for line in block.splitlines() if line.startswith("data:")
        )
        if not data or data == "[DONE]":
            continue
        obj = json.loads(data)
        if "error" in obj:
            errors.append(obj["error"])
        for choice in obj.get("choices") or []:
            text.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return "".join(text), errors


# -- the compromised third-party provider ---------------------------------------------------------


@dataclass
class ProviderControls:
    """What the provider does; read per request."""

    mode: str = "plain"  # plain | echo_system | leak
    leak_where: str = "content"  # content | second_choice | side_field | error_event | refusal
    splits: list[int] | None = None  # stream: answer split at these offsets (None: one chunk)
    leak_chars: int | None = None  # leak only the marker's first characters (a damaged copy)
    usage_prompt_tokens: int | None = None  # lie about usage
    first_token_delay_s: float = 0.0
    seen: list[dict[str, Any]] = field(default_factory=list)

    def stolen_marker(self) -> str:
        for body in self.seen:
            found = MARKER_RE.findall(json.dumps(body))
            if found:
                return found[0]
        raise AssertionError("the provider has not seen any marker to leak")


def _prompt_words(body: dict[str, Any]) -> int:
    if "messages" in body:
        return sum(len(str(m.get("content", "")).split()) + 3 for m in body["messages"])
    return len(str(body.get("prompt", "")).split())


def _answer(controls: ProviderControls, body: dict[str, Any]) -> str:
    if controls.mode == "echo_system":
        system = [m["content"] for m in body.get("messages", []) if m.get("role") == "system"]
        return f"You said: {system[0] if system else ''} -- done."
    if controls.mode == "leak" and controls.leak_where == "content":
        return f"Sure! The code is {controls.stolen_marker()[: controls.leak_chars]}, as requested."
    return "hello from the provider"


def _pieces(text: str, splits: list[int] | None) -> list[str]:
    points = sorted(set(p for p in (splits or []) if 0 < p < len(text)))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def build_provider(controls: ProviderControls) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": PROVIDER_MODEL, "object": "model"}]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await _complete(await request.json(), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _complete(await request.json(), chat=False)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Any:
        """OpenAI's embeddings answer (floats, or base64 as asked); leaking, a side field too."""
        body = await request.json()
        controls.seen.append(body)
        vector: Any = [0.25, -0.5]
        if body.get("encoding_format") == "base64":
            vector = base64.b64encode(struct.pack("<2f", 0.25, -0.5)).decode()
        out: dict[str, Any] = {"object": "list", "model": PROVIDER_MODEL}
        out["data"] = [{"object": "embedding", "index": 0, "embedding": vector}]
        out["usage"] = {"prompt_tokens": 3, "total_tokens": 3}
        if controls.mode == "leak" and controls.leak_where == "side_field":
            out["x_provider_debug"] = {"cache_hit": controls.stolen_marker()}
        return JSONResponse(out)

    async def _complete(body: dict[str, Any], *, chat: bool) -> Any:
        leaking = controls.mode == "leak"
        controls.seen.append(body)
        if leaking and controls.leak_where == "refusal":  # an OpenAI-style 400, the marker in it
            marker = controls.stolen_marker()
            error = {"message": "bad request", "type": "invalid_request_error", "param": marker}
            return JSONResponse({"error": {**error, "code": marker[5:]}}, status_code=400)
        text = _answer(controls, body)
        usage = {
            "prompt_tokens": controls.usage_prompt_tokens or _prompt_words(body),
            "completion_tokens": len(text.split()),
            "total_tokens": 0,
        }
        if body.get("stream"):
            events = _events(text, usage, chat=chat, leaking=leaking)
            return StreamingResponse(events, media_type="text/event-stream")
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        choice.update(
            {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        )
        out: dict[str, Any] = {"id": "x", "object": "chat.completion", "model": PROVIDER_MODEL}
        out.update({"choices": [choice], "usage": usage})
        if leaking and controls.leak_where == "second_choice":
            extra = {"index": 1, "finish_reason": "stop"}
            leak = controls.stolen_marker()
            extra.update(
                {"message": {"role": "assistant", "content": leak}} if chat else {"text": leak}
            )
            out["choices"].append(extra)
        if leaking and controls.leak_where == "side_field":
            out["x_provider_debug"] = {"cache_hit": controls.stolen_marker()}
        return JSONResponse(out)

    def _chunk(piece: str, *, chat: bool, index: int = 0, finish: str | None = None) -> bytes:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish}
        choice.update({"delta": {"content": piece}} if chat else {"text": piece})
        obj = {
            "id": "x",
            "object": "chat.completion.chunk",
            "model": PROVIDER_MODEL,
            "choices": [choice],
        }
        return f"data: {json.dumps(obj)}\n\n".encode()

    async def _events(text: str, usage: dict[str, int], *, chat: bool, leaking: bool):
        if controls.first_token_delay_s:
            await asyncio.sleep(controls.first_token_delay_s)
        for piece in _pieces(text, controls.splits):
            yield _chunk(piece, chat=chat)
        if leaking and controls.leak_where == "second_choice":
            for piece in _pieces(controls.stolen_marker(), controls.splits):
                yield _chunk(piece, chat=chat, index=1)
        if leaking and controls.leak_where == "side_field":
            marker = controls.stolen_marker()
            for piece in _pieces(marker, controls.splits):
                side = {"id": "x", "choices": [], "x_provider_debug": piece}
                yield f"data: {json.dumps(side)}\n\n".encode()
        if leaking and controls.leak_where == "error_event":
            error = {
                "error": {"message": f"cache entry {controls.stolen_marker()} busy", "code": "busy"}
            }
            yield f"data: {json.dumps(error)}\n\n".encode()
            return
        yield _chunk("", chat=chat, finish="stop")
        yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return app


@dataclass
class Provider:
    controls: ProviderControls
    server: RunningServer

    @property
    def url(self) -> str:
        return self.server.url

    async def stop(self) -> None:
        await self.server.stop()


async def start_provider() -> Provider:
    controls = ProviderControls()
    return Provider(controls=controls, server=await serve(build_provider(controls)))


async def eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)
