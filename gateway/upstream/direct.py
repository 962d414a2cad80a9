"""Direct path: HTTP/1.1 straight to an OpenAI-compatible engine; streamed bytes pass through
untouched.

The connections are the gateway's own (``gateway.upstream.wire``: kept alive per engine,
httptools parsing, opened in the running loop, closed with the app), so a streamed answer's
reads are pushed to the relay from the connection itself (``DirectStream.push``) instead of
waking a task per read through a client library's stream classes. A stream is opened, its status
checked before the client sees anything (so an engine 400 becomes a proper 400, not a broken 200
stream), then relayed as the engine writes; closing it early closes the connection, so the engine
sees the client go away. Request bodies are encoded with orjson (the same compact JSON, UTF-8).

A router may answer 200 with a worker's error: vLLM's PD proxy demo
(``disagg_proxy_demo.py`` ``forward_request``) relays a worker's 4xx body as it is, under
status 200, streamed or not. A 200 whose body is one JSON object carrying ``error`` (and no
``choices``) is therefore read as that error, its status the error's own ``code`` (502 when that
is no 4xx/5xx), so the client gets the engine's message, not a completion that never started.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import orjson

from gateway.upstream.base import (
    MAX_ERROR_BODY_BYTES,
    PushSource,
    Upstream,
    UpstreamCall,
    UpstreamReply,
    UpstreamStream,
    UpstreamUnreachable,
    engine_error_body,
)
from gateway.upstream.wire import Exchange, Origin, WireError, WirePool, request_head


class DirectStream(UpstreamStream):
    def __init__(self, exchange: Exchange) -> None:
        self._exchange = exchange
        self._linger = False

    def push(self) -> PushSource:
        return self._exchange

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            while chunk := await self._exchange.next_chunk():
                yield chunk
        except WireError as exc:
            raise UpstreamUnreachable(f"stream broke: {exc}") from exc

    def done_reading(self) -> None:
        self._linger = True

    async def aclose(self) -> None:
        # read to the end: back to the pool (once the engine's last bytes came); else closed
        self._exchange.release(linger=self._linger)


class DirectUpstream(Upstream):
    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float) -> None:
        # connect bounds the TCP connect only; read bounds each wait for the engine's next
        # bytes, so a slow but live stream is not cut
        self._pool = WirePool(connect_timeout_s=connect_timeout_s, read_timeout_s=read_timeout_s)
        self._origins: dict[str, Origin] = {}

    async def _send(self, call: UpstreamCall) -> Exchange:
        headers = call.outgoing_headers()
        key = call.spec.key()
        if key is not None:
            headers["authorization"] = f"Bearer {key}"
        body = _dumps(call.body)
        origin = self._origins.get(call.spec.base_url)
        if origin is None:
            origin = self._origins[call.spec.base_url] = Origin.of(call.spec.base_url)
        path = _base_path(call.spec.base_url) + call.endpoint.path
        try:
            head = request_head(origin, path, headers, len(body))
            return await self._pool.exchange(origin, head, body)
        except (WireError, ValueError) as exc:
            raise UpstreamUnreachable(str(exc)) from exc

    async def complete(self, call: UpstreamCall) -> UpstreamReply:
        exchange = await self._send(call)
        try:
            content = await exchange.read_all()
        except WireError as exc:
            raise UpstreamUnreachable(str(exc)) from exc
        finally:
            exchange.release()
        assert content is not None
        body = _json_or_none(content)
        if exchange.status != 200:
            body = engine_error_body(body)
        elif (relayed := _relayed_error(body)) is not None:
            return relayed
        return UpstreamReply(status=exchange.status, body=body, raw=_utf8_or_none(content))

    async def stream(self, call: UpstreamCall) -> UpstreamStream | UpstreamReply:
        exchange = await self._send(call)
        try:
            first = await exchange.next_chunk() if exchange.status == 200 else b""
        except WireError as exc:
            exchange.release()
            raise UpstreamUnreachable(f"stream broke: {exc}") from exc
        if exchange.status == 200 and not first.lstrip().startswith(b"{"):  # SSE: "data: ..."
            exchange._pending.insert(0, first)  # the relay reads it first
            return DirectStream(exchange)
        try:
            rest = await exchange.read_all(MAX_ERROR_BODY_BYTES)
        except WireError:
            rest = None
        finally:
            exchange.release()
        body = _json_or_none(first + rest) if rest is not None else None
        if exchange.status != 200:
            return UpstreamReply(status=exchange.status, body=engine_error_body(body))
        return _relayed_error(body) or UpstreamReply(status=502, body=None)

    async def close(self) -> None:
        self._pool.close()


def _base_path(base_url: str) -> str:
    """The path part of an engine's base URL (a router mounted below a prefix)."""
    rest = base_url.split("://", 1)[-1]
    slash = rest.find("/")
    return rest[slash:].rstrip("/") if slash >= 0 else ""


def _dumps(body: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(body)
    except TypeError:  # an integer past 64 bits: the standard encoder takes it
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def _relayed_error(body: dict[str, Any] | None) -> UpstreamReply | None:
    """A 200 whose body is a worker's error (see the module docstring), as that error."""
    body = engine_error_body(body)
    error = None if body is None or "choices" in body else body.get("error")
    if not isinstance(error, dict):
        return None
    code = error.get("code")
    if isinstance(code, bool) or not isinstance(code, int) or not 400 <= code < 600:
        code = 502
    return UpstreamReply(status=code, body=body)


def _utf8_or_none(content: bytes) -> str | None:
    """The JSON text as sent (the side-field prefilter reads it); None unless strict UTF-8."""
    try:
        return content.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _json_or_none(content: bytes) -> dict[str, Any] | None:
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        try:  # what orjson refuses and Python reads (NaN, lone surrogates, huge integers)
            data = json.loads(content)
        except (ValueError, RecursionError):
            return None
    return data if isinstance(data, dict) else None
