"""Seams where other parts (the canary) plug into the request and response paths.

- ``RequestHook.prepare``: may rewrite the upstream body before tokens are counted (so an
  injected canary marker is counted and limited like any other prompt text).
- ``GuardFactory.open`` -> ``StreamGuard``: sees every piece of response text in order,
  streaming or not. ``feed`` returns the text to deliver now (it may hold some back: a marker
  could be completing across chunks) or a ``Cut``; ``finish`` releases what was held back, or
  cuts. After a ``Cut`` the gateway sends an OpenAI-style error (an SSE error event mid-stream,
  an error response otherwise), closes the upstream and calls ``on_cut``.
- ``on_cut``: told ids only (request, tenant, engine), never content.

The default hooks pass everything through untouched, so streamed bytes reach the client exactly
as the engine sent them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class RequestInfo:
    request_id: str
    tenant_id: str
    model: str
    endpoint: str
    synthetic: bool
    canary_sample_rate: float
    engine: str | None = None


@dataclass(frozen=True, slots=True)
class Emit:
    text: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class Cut:
    code: str  # stable, e.g. "isolation_violation"
    message: str  # shown to the client: must name no content
    status: int = 502


class StreamGuard(Protocol):
    def feed(self, text: str) -> Emit | Cut: ...

    def finish(self) -> Emit | Cut: ...


class GuardFactory(Protocol):
    def open(self, info: RequestInfo) -> StreamGuard: ...


class RequestHook(Protocol):
    async def prepare(self, info: RequestInfo, body: dict[str, Any]) -> dict[str, Any]: ...


class PassThroughGuard:
    def feed(self, text: str) -> Emit | Cut:
        return Emit(text)

    def finish(self) -> Emit | Cut:
        return Emit("")


class PassThroughFactory:
    def open(self, info: RequestInfo) -> StreamGuard:
        return PassThroughGuard()


OnCut = Callable[[RequestInfo, Cut], Awaitable[None]]


@dataclass(slots=True)
class GatewayHooks:
    request_hooks: list[RequestHook] = field(default_factory=list)
    guards: GuardFactory = field(default_factory=PassThroughFactory)
    on_cut: OnCut | None = None
