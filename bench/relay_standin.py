"""A STAND-IN engine for the relay benchmark: an upstream that costs almost nothing.

It is not an engine (nothing is computed): it answers every completion with the same fixed text,
so the CPU a relay spends in front of it is the relay's own. Run:
``python -m bench.relay_standin --port P [--port Q ...] [--interval-ms 10] [--window 131072]``;
it prints ``ready`` once every port listens.

Shapes (what the gateway, LiteLLM and the floors read):

- ``POST /v1/chat/completions`` and ``/v1/completions``: ``max_tokens`` (default 16) tokens of
  a fixed English text. Streaming (``"stream": true``) follows vLLM's OpenAI server at commit
  003fe59 (``vllm/entrypoints/openai/serving_chat.py``, ``chat_completion_stream_generator``):
  one chunk with ``delta: {"role": "assistant", "content": ""}``, then one chunk per token
  (``logprobs: null``, ``finish_reason: null``), the last with ``finish_reason: "length"`` and
  ``stop_reason: null``, then, when ``stream_options.include_usage`` is set, a chunk with
  ``choices: []`` and ``usage``, then ``data: [DONE]`` -- ``max_tokens + 3`` events for the
  64-token answers the issue measured (67). The bundled engine's chunks
  (``backend/server/formatting.py``) are the same but for ``logprobs``/``stop_reason``. Each
  event is its own HTTP chunk and its own write (uvicorn's framing: ``Transfer-Encoding:
  chunked``); token ``i`` is written ``i * interval`` after the request arrived, the usage chunk
  and ``[DONE]`` right after the last token. Non-streaming answers are one JSON body with usage.
- ``GET /engine/capacity``: the bundled engine's ``CapacityReport`` with its byte tokenizer, so
  the gateway counts prompts itself as it does in front of the bundled engine; ``GET /v1/models``
  and ``POST /tokenize`` (vLLM's ``{"count": N}``, one token per UTF-8 byte).

The server is a raw asyncio protocol on uvloop with httptools parsing; responses are built from
templates made once per answer length, so the stand-in's own CPU per event is a few µs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any

import uvloop

from bench.relay_http import RequestReader
from contracts.chat_format import TOKENIZER_ID, count_tokens
from contracts.engine import CapacityReport, Role

MODEL = "standin-model"
ANSWER = (
    "The quick answer is that a gateway should cost little beyond moving bytes. Careful "
    "measurement shows where each microsecond goes: parsing, checking, encoding and writing. "
    "Every check stays on, and the client receives the same tokens the engine produced. "
)
MAX_TOKENS_CAP = 8192
_JSON = {"content-type": "application/json"}


def answer_tokens(count: int) -> list[str]:
    """``count`` tokens of the fixed answer (words with their leading space), repeating."""
    words = ANSWER.split(" ")
    return [(" " if i else "") + words[i % len(words)] for i in range(count)]


def _dump(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


@dataclass(frozen=True, slots=True)
class Answer:
    """The byte templates of one (endpoint, length) answer. Each piece follows the response id;
    the usage chunk's and the body's end with ``"usage":`` (the usage object and ``}`` follow)."""

    events: tuple[bytes, ...]  # streamed events, without the usage chunk and [DONE]
    usage_event: bytes
    body: bytes  # the non-streaming body


def _after_id(obj: dict[str, Any]) -> bytes:
    """The JSON of ``obj`` (whose first key is ``id``) after the id's value."""
    text = _dump(obj)
    head = b'{"id":"X"'
    assert text.startswith(head)
    return text[len(head) :]


def _before_usage(obj: dict[str, Any]) -> bytes:
    """The JSON of ``obj`` after its id, without its closing brace, then ``,"usage":``."""
    return _after_id(obj)[:-1] + b',"usage":'


def usage(prompt_tokens: int, completion_tokens: int) -> bytes:
    return _dump(
        {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
    )


def build_answer(chat: bool, count: int, created: int) -> Answer:
    kind = "chat.completion" if chat else "text_completion"
    chunk_kind = "chat.completion.chunk" if chat else "text_completion"
    tokens = answer_tokens(count)

    def envelope(obj: str) -> dict[str, Any]:
        return {"id": "X", "object": obj, "created": created, "model": MODEL}

    def choice(text: str, finish: str | None, first: bool = False) -> dict[str, Any]:
        if chat:
            delta = {"role": "assistant", "content": ""} if first else {"content": text}
            out: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            out = {"index": 0, "text": text}
        out["logprobs"] = None
        out["finish_reason"] = finish
        if finish is not None:
            out["stop_reason"] = None
        return out

    chunks = [{**envelope(chunk_kind), "choices": [choice("", None, first=True)]}]
    for i, token in enumerate(tokens):
        finish = "length" if i == count - 1 else None
        chunks.append({**envelope(chunk_kind), "choices": [choice(token, finish)]})
    text = "".join(tokens)
    if chat:
        message = {"role": "assistant", "content": text, "tool_calls": []}
        full_choice: dict[str, Any] = {"index": 0, "message": message}
    else:
        full_choice = {"index": 0, "text": text}
    full_choice.update(logprobs=None, finish_reason="length", stop_reason=None)
    return Answer(
        events=tuple(_after_id(c) for c in chunks),
        usage_event=_before_usage({**envelope(chunk_kind), "choices": []}),
        body=_before_usage({**envelope(kind), "choices": [full_choice]}),
    )


def prompt_tokens(request: dict[str, Any]) -> int:
    """What the engine would report: the bundled byte tokenizer's count (the gateway's own)."""
    counted = count_tokens(request.get("prompt"), request.get("messages"))
    if counted is not None:
        return counted
    return len(json.dumps(request.get("prompt") or request.get("messages")).encode()) + 1


def capacity(window: int) -> bytes:
    page = 16
    pages = (window * 4) // page
    report = CapacityReport(
        model=MODEL,
        role=Role.UNIFIED,
        protocol_version=1,
        page_size=page,
        pool_pages=pages,
        pool_tokens=pages * page,
        free_pages=pages,
        context_window=window,
        max_request_tokens=window,
        zero_on_free=False,
        tokenizer=TOKENIZER_ID,
    )
    return report.model_dump_json().encode()


def models(window: int) -> bytes:
    card = {"id": MODEL, "object": "model", "created": 0, "owned_by": "standin"}
    return _dump({"object": "list", "data": [{**card, "max_model_len": window}]})


class Standin:
    """What every connection shares: settings, answer templates, fixed bodies."""

    def __init__(self, *, interval_s: float, window: int) -> None:
        self.interval_s = interval_s
        self.created = int(time.time())
        self.capacity = capacity(window)
        self.models = models(window)
        self._answers: dict[tuple[bool, int], Answer] = {}

    def answer(self, chat: bool, count: int) -> Answer:
        key = (chat, count)
        found = self._answers.get(key)
        if found is None:
            found = self._answers[key] = build_answer(chat, count, self.created)
        return found


def _head(status: int, headers: dict[str, str], length: int | None) -> bytes:
    lines = [f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append(
        f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    )
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class StandinProtocol(RequestReader):
    """One client connection: HTTP/1.1 keep-alive, one request at a time."""

    def __init__(self, standin: Standin) -> None:
        super().__init__()
        self.standin = standin
        self.timers: list[asyncio.TimerHandle] = []

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in self.timers:
            timer.cancel()
        self.transport = None

    def refused(self) -> None:
        self._send(400, _JSON, b'{"error":{"message":"bad request"}}')

    def request(self, url: bytes, body: bytes) -> None:
        path = url.split(b"?", 1)[0]
        method = self.parser.get_method()
        if method == b"GET":
            self._get(path)
        elif path in (b"/v1/chat/completions", b"/v1/completions"):
            self._complete(path == b"/v1/chat/completions", body)
        elif path == b"/tokenize":
            self._send(200, _JSON, _dump({"count": prompt_tokens(json.loads(body))}))
        else:
            self._send(404, _JSON, b'{"error":{"message":"not found"}}')

    def _get(self, path: bytes) -> None:
        if path == b"/engine/capacity":
            self._send(200, _JSON, self.standin.capacity)
        elif path == b"/v1/models":
            self._send(200, _JSON, self.standin.models)
        elif path == b"/health":
            self._send(200, _JSON, b'{"status":"ok"}')
        else:
            self._send(404, _JSON, b'{"error":{"message":"not found"}}')

    def _send(self, status: int, headers: dict[str, str], body: bytes) -> None:
        if self.transport is not None:
            self.transport.write(_head(status, headers, len(body)) + body)

    def _complete(self, chat: bool, raw: bytes) -> None:
        request = json.loads(raw)
        count = request.get("max_tokens") or request.get("max_completion_tokens") or 16
        count = max(1, min(int(count), MAX_TOKENS_CAP))
        answer = self.standin.answer(chat, count)
        rid = (b"chatcmpl-" if chat else b"cmpl-") + uuid.uuid4().hex.encode()
        used = usage(prompt_tokens(request), count) + b"}"
        if not request.get("stream"):
            self._send(200, _JSON, b'{"id":"' + rid + b'"' + answer.body + used)
            return
        head = b'data: {"id":"' + rid + b'"'
        options = request.get("stream_options") or {}
        tail = [head + answer.usage_event + used + b"\n\n"] if options.get("include_usage") else []
        tail.append(b"data: [DONE]\n\n")
        assert self.transport is not None
        sse = {"content-type": "text/event-stream", "cache-control": "no-cache"}
        self.transport.write(_head(200, sse, None) + _chunk(head + answer.events[0] + b"\n\n"))
        loop = asyncio.get_running_loop()
        start = loop.time()
        step = self.standin.interval_s
        events = answer.events
        for i in range(1, len(events)):
            last = i == len(events) - 1
            self.timers.append(
                loop.call_at(start + i * step, self._emit, head, events[i], tail if last else None)
            )

    def _emit(self, head: bytes, event: bytes, tail: list[bytes] | None) -> None:
        transport = self.transport
        if transport is None:
            return
        transport.write(_chunk(head + event + b"\n\n"))
        if tail is not None:
            for piece in tail:
                transport.write(_chunk(piece))
            transport.write(b"0\r\n\r\n")
            self.timers.clear()


async def serve(ports: list[int], *, interval_s: float, window: int) -> None:
    standin = Standin(interval_s=interval_s, window=window)
    loop = asyncio.get_running_loop()
    servers = [
        await loop.create_server(lambda: StandinProtocol(standin), "127.0.0.1", port, backlog=4096)
        for port in ports
    ]
    print("ready", flush=True)
    await asyncio.gather(*(server.serve_forever() for server in servers))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, action="append", required=True)
    parser.add_argument("--interval-ms", type=float, default=10.0, help="between streamed tokens")
    parser.add_argument("--window", type=int, default=131072, help="context window reported")
    args = parser.parse_args(argv)
    uvloop.run(serve(args.port, interval_s=args.interval_ms / 1000, window=args.window))
    return 0


if __name__ == "__main__":
    sys.exit(main())
