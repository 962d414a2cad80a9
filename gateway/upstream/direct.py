"""Direct path: aiohttp to an OpenAI-compatible engine; streamed bytes pass through untouched.

One shared ``aiohttp.ClientSession`` (opened on first use, in the running loop; closed with the
app) keeps connections to every engine alive. aiohttp rather than httpx because this is the hot
path: `python -m bench.bench_http_client` measures a request here at under a quarter of httpx's
CPU (httpx stays for the capacity poller and token counting, which are not per-request).
A stream is opened, its status checked before the client sees anything (so an engine 400 becomes
a proper 400, not a broken 200 stream), then relayed chunk by chunk as the engine writes; closing
it early closes the connection, so the engine sees the client go away.

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

import aiohttp

from gateway.upstream.base import (
    MAX_ERROR_BODY_BYTES,
    Upstream,
    UpstreamCall,
    UpstreamReply,
    UpstreamStream,
    UpstreamUnreachable,
    engine_error_body,
)

_FAILURES = (aiohttp.ClientError, TimeoutError)


class DirectStream(UpstreamStream):
    def __init__(self, response: aiohttp.ClientResponse, first: bytes) -> None:
        self._response = response
        self._first = first  # read already, to tell a stream from a relayed error

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._first:
            yield self._first
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except _FAILURES as exc:
            raise UpstreamUnreachable(f"stream broke: {exc.__class__.__name__}") from exc

    async def aclose(self) -> None:
        if self._response.content.at_eof():
            self._response.release()  # read to the end: the connection goes back to the pool
        else:
            self._response.close()  # stopped early: drop the connection, the engine stops too


class DirectUpstream(Upstream):
    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float) -> None:
        # connect bounds the TCP connect only (not a wait for a pooled connection); sock_read
        # bounds each wait for the engine's next bytes, so a slow but live stream is not cut
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=read_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # opened in the running loop, on first use
            connector = aiohttp.TCPConnector(limit=1000, limit_per_host=0, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, raise_for_status=False
            )
        return self._session

    async def _send(self, call: UpstreamCall) -> aiohttp.ClientResponse:
        headers = {**call.outgoing_headers(), "Content-Type": "application/json"}
        key = call.spec.key()
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = json.dumps(call.body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        url = f"{call.spec.base_url}{call.endpoint.path}"
        try:
            return await self._client().post(
                url, data=data.encode(), headers=headers, allow_redirects=False
            )
        except _FAILURES as exc:
            raise UpstreamUnreachable(exc.__class__.__name__) from exc

    async def complete(self, call: UpstreamCall) -> UpstreamReply:
        response = await self._send(call)
        try:
            content = await response.read()
        except _FAILURES as exc:
            raise UpstreamUnreachable(exc.__class__.__name__) from exc
        finally:
            response.release()
        body = _json_or_none(content)
        if response.status != 200:
            body = engine_error_body(body)
        elif (relayed := _relayed_error(body)) is not None:
            return relayed
        return UpstreamReply(status=response.status, body=body, raw=_utf8_or_none(content))

    async def stream(self, call: UpstreamCall) -> UpstreamStream | UpstreamReply:
        response = await self._send(call)
        if response.status == 200:
            first = await _first_chunk(response)
            if not first.lstrip().startswith(b"{"):  # SSE: "data: ..."
                return DirectStream(response, first)
        else:
            first = b""
        try:
            body = _json_or_none(first + await _read_bounded(response))
        finally:
            response.close()
        if response.status != 200:
            return UpstreamReply(status=response.status, body=engine_error_body(body))
        return _relayed_error(body) or UpstreamReply(status=502, body=None)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


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


async def _first_chunk(response: aiohttp.ClientResponse) -> bytes:
    try:
        async for chunk in response.content.iter_any():
            return chunk
    except _FAILURES as exc:
        response.close()
        raise UpstreamUnreachable(f"stream broke: {exc.__class__.__name__}") from exc
    return b""


async def _read_bounded(response: aiohttp.ClientResponse) -> bytes:
    data = b""
    try:
        async for chunk in response.content.iter_any():
            data += chunk
            if len(data) > MAX_ERROR_BODY_BYTES:
                return b""
    except _FAILURES:
        return b""
    return data


def _utf8_or_none(content: bytes) -> str | None:
    """The JSON text as sent (the side-field prefilter reads it); None unless strict UTF-8."""
    try:
        return content.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _json_or_none(content: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(content)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
