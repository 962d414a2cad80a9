"""Direct path: httpx to an OpenAI-compatible engine; streamed bytes pass through untouched.

One shared ``httpx.AsyncClient`` (created in the app lifespan) keeps connections to every engine
alive. A stream is opened, its status checked before the client sees anything (so an engine 400
becomes a proper 400, not a broken 200 stream), then relayed chunk by chunk as the engine writes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx

from gateway.upstream.base import (
    MAX_ERROR_BODY_BYTES,
    Upstream,
    UpstreamCall,
    UpstreamReply,
    UpstreamStream,
    UpstreamUnreachable,
)


class DirectStream(UpstreamStream):
    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_bytes():
                yield chunk
        except httpx.HTTPError as exc:
            raise UpstreamUnreachable(f"stream broke: {exc.__class__.__name__}") from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class DirectUpstream(Upstream):
    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    def _request(self, call: UpstreamCall) -> httpx.Request:
        headers = dict(call.headers)
        if call.spec.api_key is not None:
            headers["Authorization"] = f"Bearer {call.spec.api_key.get_secret_value()}"
        url = f"{call.spec.base_url}{call.endpoint.path}"
        return self._client.build_request("POST", url, json=call.body, headers=headers)

    async def complete(self, call: UpstreamCall) -> UpstreamReply:
        try:
            response = await self._client.send(self._request(call))
        except httpx.HTTPError as exc:
            raise UpstreamUnreachable(exc.__class__.__name__) from exc
        return UpstreamReply(status=response.status_code, body=_json_or_none(response.content))

    async def stream(self, call: UpstreamCall) -> UpstreamStream | UpstreamReply:
        try:
            response = await self._client.send(self._request(call), stream=True)
        except httpx.HTTPError as exc:
            raise UpstreamUnreachable(exc.__class__.__name__) from exc
        if response.status_code == 200:
            return DirectStream(response)
        try:
            body = await _read_bounded(response)
        finally:
            await response.aclose()
        return UpstreamReply(status=response.status_code, body=_json_or_none(body))


async def _read_bounded(response: httpx.Response) -> bytes:
    data = b""
    try:
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) > MAX_ERROR_BODY_BYTES:
                return b""
    except httpx.HTTPError:
        return b""
    return data


def _json_or_none(content: bytes) -> dict[str, Any] | None:
    try:
        data = json.loads(content)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
