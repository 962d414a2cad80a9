"""A STAND-IN engine for gateway component tests: a real HTTP server (uvicorn on 127.0.0.1) that
speaks the shapes the gateway consumes — the bundled backend's ``/engine/capacity``
(``CapacityReport``), ``/tokenize``, OpenAI-compatible ``/v1/chat/completions`` and
``/v1/completions`` (SSE with ``stream_options.include_usage``) and ``/v1/models``.

It is NOT the kvguard engine and no test that uses it claims end-to-end behaviour: it exists to
exercise the gateway's own code (adapters, poller, admission, relay, limits) with controllable
numbers and timing. End-to-end tests run against the real engine (``engine_factory``).

Its tokenizer is deliberately simple and public (``standin_count``) so tests can compute exact
expectations: one token per whitespace-separated word, plus ``MESSAGE_OVERHEAD`` per chat message.
Its completion echoes the last user message (or the prompt) word by word.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from contracts.engine import CAPACITY_SCHEMA_VERSION
from kvguard.testing import RunningServer, serve

MESSAGE_OVERHEAD = 3
MODEL = "standin-model"


def standin_count(prompt: str | None = None, messages: list[dict[str, Any]] | None = None) -> int:
    if messages is not None:
        return sum(len(str(m.get("content", "")).split()) + MESSAGE_OVERHEAD for m in messages)
    return len((prompt or "").split())


@dataclass
class StandInControls:
    """Knobs a test turns; every field is read per request."""

    model: str = MODEL
    context_window: int = 4096
    pool_tokens: int = 4096
    page_size: int = 16
    faults: list[str] = field(default_factory=list)
    drift: str | None = None
    capacity_status: int = 200
    chunk_delay_s: float = 0.0
    gate: asyncio.Event | None = None  # when set: completions wait for it before answering
    omit_done: bool = False
    completion_status: int = 200  # != 200: completions answer this status (an upstream failure)
    break_after_words: int | None = None  # streaming: drop the connection after this many words
    handoff: dict[str, Any] | None = None
    seen_headers: list[dict[str, str]] = field(default_factory=list)
    seen_bodies: list[dict[str, Any]] = field(default_factory=list)
    sent_chunks: list[bytes] = field(default_factory=list)
    refuse_above: int | None = None  # refuse requests larger than this though capacity says more
    tokenize_calls: int = 0
    active_streams: int = 0
    cancelled_streams: int = 0

    def max_request_tokens(self) -> int:
        return min(self.context_window, self.pool_tokens)

    def capacity(self) -> dict[str, Any]:
        pages = self.pool_tokens // self.page_size
        return {
            "schema_version": CAPACITY_SCHEMA_VERSION,
            "model": self.model,
            "role": "unified",
            "protocol_version": 1,
            "page_size": self.page_size,
            "pool_pages": pages,
            "pool_tokens": pages * self.page_size,
            "free_pages": pages,
            "quarantined_pages": 0,
            "context_window": self.context_window,
            "max_request_tokens": self.max_request_tokens(),
            "zero_on_free": False,
            "drift": self.drift,
            "faults": list(self.faults),
            "roles": [],
        }


def _error(status: int, message: str, code: str) -> JSONResponse:
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}
    }
    return JSONResponse(body, status_code=status)


def _answer_words(body: dict[str, Any]) -> list[str]:
    if "messages" in body:
        users = [m["content"] for m in body["messages"] if m.get("role") == "user"]
        text = users[-1] if users else ""
    else:
        text = body.get("prompt", "")
    return text.split()[: int(body.get("max_tokens", 16))]


def build_app(controls: StandInControls) -> FastAPI:
    app = FastAPI()

    @app.get("/engine/capacity")
    async def capacity() -> JSONResponse:
        if controls.capacity_status != 200:
            return JSONResponse({"detail": "down"}, status_code=controls.capacity_status)
        return JSONResponse(controls.capacity())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        controls.tokenize_calls += 1
        body = await request.json()
        count = standin_count(body.get("prompt"), body.get("messages"))
        return JSONResponse(
            {"count": count, "tokens": list(range(count)), "max_model_len": controls.context_window}
        )

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {"id": controls.model, "object": "model", "max_model_len": controls.context_window}
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        return await _complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        return await _complete(request, chat=False)

    async def _complete(request: Request, *, chat: bool) -> Any:
        body = await request.json()
        controls.seen_headers.append(dict(request.headers))
        controls.seen_bodies.append(body)
        prompt_tokens = standin_count(body.get("prompt"), body.get("messages"))
        limit = min(controls.max_request_tokens(), controls.refuse_above or 1 << 40)
        if prompt_tokens + int(body.get("max_tokens", 16)) > limit:
            return _error(400, "prompt too long for this engine", "context_length_exceeded")
        if controls.gate is not None:
            await controls.gate.wait()
        if controls.completion_status != 200:
            return JSONResponse(
                {"detail": "engine failure"}, status_code=controls.completion_status
            )
        words = _answer_words(body)
        if body.get("stream"):
            return StreamingResponse(
                _stream(body, words, prompt_tokens, chat=chat), media_type="text/event-stream"
            )
        return JSONResponse(_full(body, words, prompt_tokens, chat=chat))

    def _usage(prompt_tokens: int, completion: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }

    def _full(body: dict[str, Any], words: list[str], prompt_tokens: int, *, chat: bool) -> dict:
        text = " ".join(words)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
        choice.update(
            {"message": {"role": "assistant", "content": text}} if chat else {"text": text}
        )
        out = {
            "id": "cmpl-standin",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": controls.model,
            "choices": [choice],
            "usage": _usage(prompt_tokens, len(words)),
        }
        if controls.handoff is not None:
            out["handoff"] = controls.handoff
        return out

    def _sent(event: dict[str, Any] | bytes) -> bytes:
        """One SSE event as the bundled engine writes it: compact JSON on one line (orjson's
        form, which the gateway passes byte for byte)."""
        if isinstance(event, bytes):
            chunk = event
        else:
            chunk = b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"
        controls.sent_chunks.append(chunk)
        return chunk

    async def _stream(body: dict[str, Any], words: list[str], prompt_tokens: int, *, chat: bool):
        controls.active_streams += 1
        base = {
            "id": "cmpl-standin",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": controls.model,
        }
        try:
            for i, word in enumerate(words):
                if controls.break_after_words is not None and i == controls.break_after_words:
                    raise RuntimeError("stand-in drops the connection")
                piece = word if i == 0 else " " + word
                choice: dict[str, Any] = {"index": 0, "finish_reason": None}
                choice.update({"delta": {"content": piece}} if chat else {"text": piece})
                yield _sent({**base, "choices": [choice]})
                if controls.chunk_delay_s:
                    await asyncio.sleep(controls.chunk_delay_s)
            last: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
            last.update({"delta": {}} if chat else {"text": ""})
            yield _sent({**base, "choices": [last]})
            if (body.get("stream_options") or {}).get("include_usage"):
                usage: dict[str, Any] = {
                    **base,
                    "choices": [],
                    "usage": _usage(prompt_tokens, len(words)),
                }
                if controls.handoff is not None:
                    usage["handoff"] = controls.handoff
                yield _sent(usage)
            if not controls.omit_done:
                yield _sent(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            controls.cancelled_streams += 1
            raise
        finally:
            controls.active_streams -= 1

    return app


@dataclass
class StandInEngine:
    controls: StandInControls
    running: RunningServer

    @property
    def url(self) -> str:
        return self.running.url

    async def stop(self) -> None:
        if self.controls.gate is not None:
            self.controls.gate.set()
        await self.running.stop()


async def start_standin(controls: StandInControls | None = None) -> StandInEngine:
    controls = controls or StandInControls()
    return StandInEngine(controls=controls, running=await serve(build_app(controls)))


def static_app(routes: dict[str, tuple[int, str, str]]) -> FastAPI:
    """GET routes answering fixed payloads: path -> (status, media type, body)."""
    app = FastAPI()
    for path, (status, media_type, body) in routes.items():

        def handler(status: int = status, media_type: str = media_type, body: str = body) -> Any:
            return PlainTextResponse(body, status_code=status, media_type=media_type)

        app.add_api_route(path, handler, methods=["GET"])
    return app
