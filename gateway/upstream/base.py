"""The upstream contract: call an engine's OpenAI-compatible routes (completions, embeddings).

Two paths implement it: ``direct`` (aiohttp straight to an OpenAI-compatible engine, bytes passed
through untouched) and ``litellm`` (providers that need translation). A call either answers
(status + JSON), opens a stream of raw SSE bytes, or raises ``UpstreamUnreachable`` (connection
refused, timeout, protocol error) which the gateway maps to 502.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from gateway.engines.spec import EngineSpec

MAX_ERROR_BODY_BYTES = 64 << 10


class Endpoint(StrEnum):
    CHAT = "chat.completions"
    COMPLETIONS = "completions"
    RESPONSES = "responses"  # a native engine's own /v1/responses (``gateway.proxy.responses``)
    EMBEDDINGS = "embeddings"

    @property
    def path(self) -> str:
        return "/v1/" + self.value.replace(".", "/")


@dataclass(frozen=True, slots=True)
class UpstreamCall:
    spec: EngineSpec
    endpoint: Endpoint
    body: dict[str, Any] = field(repr=False)  # holds the prompt
    headers: dict[str, str]  # the gateway's own: tenant id, request id, trace context

    def outgoing_headers(self) -> dict[str, str]:
        """The gateway's headers as they may leave: none to a third party unless opted in."""
        return dict(self.headers) if self.spec.sends_kvguard_headers else {}


@dataclass(frozen=True, slots=True)
class UpstreamReply:
    """A complete answer: 200 with a completion, or the engine's error before any stream."""

    status: int
    body: dict[str, Any] | None = field(repr=False)
    raw: str | None = field(default=None, repr=False)  # the body's JSON text, when kept


def engine_error_body(body: dict[str, Any] | None) -> dict[str, Any] | None:
    """An engine's error in OpenAI's shape: SGLang answers a flat ``{"object": "error", "message",
    "type", "param", "code"}`` (its ``ErrorResponse``), OpenAI and vLLM nest it under ``error``."""
    if body is None or "error" in body or body.get("object") != "error":
        return body
    fields = ("message", "type", "param", "code")
    return {"error": {name: body.get(name) for name in fields}}


class UpstreamUnreachable(RuntimeError):
    """No answer from the engine (the message names the failure class, never content)."""


class BodySink(Protocol):
    """Where a pushed stream's bytes go, from the connection's own reads (``gateway.proxy.stream``
    is one)."""

    def data(self, chunk: bytes) -> None: ...

    def end(self) -> None: ...

    def lost(self, error: Exception) -> None: ...


class PushSource(Protocol):
    """A stream that pushes its bytes to a sink as they arrive (no task wakes up per read)."""

    def attach(self, sink: BodySink) -> None: ...

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class UpstreamStream(ABC):
    @abstractmethod
    def chunks(self) -> AsyncIterator[bytes]:
        """Raw SSE bytes as they arrive; raises ``UpstreamUnreachable`` if the engine drops."""

    def push(self) -> PushSource | None:
        """The same bytes pushed to a sink instead, when this stream can (default: it cannot;
        then the relay pulls ``chunks``)."""
        return None

    def done_reading(self) -> None:  # noqa: B027 (optional hook)
        """The relay read the stream to its end: ``aclose`` may keep the connection for another
        request once the engine has finished the response (default: nothing to keep)."""

    @abstractmethod
    async def aclose(self) -> None:
        """Stop reading and close the connection (the engine sees the client go away)."""


class Upstream(ABC):
    @abstractmethod
    async def complete(self, call: UpstreamCall) -> UpstreamReply: ...

    @abstractmethod
    async def stream(self, call: UpstreamCall) -> UpstreamStream | UpstreamReply:
        """An open 200 stream, or the engine's non-200 answer (read in full, bounded)."""

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Release clients; default none."""
