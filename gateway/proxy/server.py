"""The gateway's HTTP server protocol: uvicorn's (httptools), guarded, with a way below ASGI.

``DataPlaneProtocol`` is ``contracts.http_edge.GuardedHttpProtocol`` -- uvicorn's httptools
protocol with a deadline and a size bound on every request head, so parsing, request smuggling
defences, keep-alive and pipelining are uvicorn's -- that hands every request it starts a
``Direct`` handle in its scope (``scope["extensions"]["kvguard.direct"]``): the connection and
uvicorn's cycle of that request. The completion routes (``gateway.proxy.door``) use it to write a
stream's chunks straight to the socket (``gateway.proxy.reply.DirectReply``); every other route
is FastAPI's, as under any ASGI server. The protocol calls back the request's watchers when the
client goes away (its lease is released at once, without a task watching ``receive``) and
``on_writable`` when a full socket drains (the engine's connection, paused, is read again).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from contracts.http_edge import DEFAULT_MAX_HEAD_BYTES, GuardedHttpProtocol
from gateway.proxy.reply import DIRECT


@dataclass(frozen=True, slots=True)
class Direct:
    """The connection and uvicorn's cycle of one request. The cycle is held weakly: its scope
    holds this handle, and a strong reference back would make every request a reference cycle
    that only the garbage collector frees, with everything the request touched (the running
    request holds its cycle; ``DirectReply`` takes it at the start)."""

    connection: DataPlaneProtocol
    _cycle: weakref.ref[Any]  # uvicorn.protocols.http.httptools_impl.RequestResponseCycle

    @property
    def cycle(self) -> Any:
        cycle = self._cycle()
        if cycle is None:
            raise RuntimeError("the request's cycle has ended")
        return cycle


class DataPlaneProtocol(GuardedHttpProtocol):
    watchers: set[Callable[[], None]]
    on_writable: Callable[[], None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.watchers = set()
        self.on_writable = None
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        for gone in list(self.watchers):
            gone()
        self.watchers.clear()

    def resume_writing(self) -> None:
        super().resume_writing()
        writable = self.on_writable
        if writable is not None:
            writable()

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        cycle.scope.setdefault("extensions", {})[DIRECT] = Direct(self, weakref.ref(cycle))
        super()._start_asgi_task(cycle, app)


def data_plane_protocol(
    *, header_timeout_s: float, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
) -> type[DataPlaneProtocol]:
    """A ``DataPlaneProtocol`` class with these head bounds (uvicorn makes one per connection)."""
    attrs = {"header_timeout_s": header_timeout_s, "max_head_bytes": max_head_bytes}
    return type("DataPlaneProtocol", (DataPlaneProtocol,), attrs)
