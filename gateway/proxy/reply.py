"""How a tenant request's answer reaches the client: an ASGI reply, or the direct one below ASGI.

A ``Reply`` sends a whole answer (an error or a completion: one head, one body) or a stream:
``start_stream`` sends the head, ``write`` sends a chunk of relayed events without awaiting
(``gateway.proxy.stream.StreamPump`` calls it from the engine connection's reads), ``drain``
waits while the client cannot take more, and ``end_stream`` sends the last bytes and ends the
body. ``watch`` cancels the request when the client goes away.

- ``AsgiReply`` speaks ASGI messages through ``send`` (any ASGI server, in-process test clients):
  a written chunk waits in a list until ``drain`` sends it, so only a pull loop may feed it; the
  client going away is read from ``receive`` by a watcher task.
- ``DirectReply``: under the gateway's own server protocol (``gateway.proxy.server``), a written
  chunk goes straight to the client's socket as one HTTP chunk (no message, no middleware, no
  await), so the engine connection's reads can push to it; the protocol calls back when the
  client goes away or can take more. Heads and the final bytes still go through ``send`` (the
  request-id headers, uvicorn's keep-alive and pipelining bookkeeping); a whole answer's head
  and body leave in one socket write.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import anyio
import orjson
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

log = logging.getLogger("kvguard.gateway.proxy")

DIRECT = "kvguard.direct"  # the scope extension the gateway's protocol sets (its connection)
_SSE_HEAD = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]


class ClientGone(Exception):
    """Sending to the client failed: it went away."""


def _raw(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


class AsgiReply:
    direct = False

    def __init__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.scope, self.receive, self._send = scope, receive, send
        self._pending: list[bytes] = []
        self._watcher: asyncio.Task[None] | None = None

    async def send(self, message: Message) -> None:
        try:
            await self._send(message)
        except OSError as exc:  # an ASGI server that raises once the client is gone
            raise ClientGone from exc

    async def respond(self, response: Response) -> None:
        await response(self.scope, self.receive, self._send)

    async def json(self, status: int, body: Any, headers: dict[str, str]) -> None:
        payload = orjson.dumps(body)
        raw = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            *_raw(headers),
        ]
        await self.send({"type": "http.response.start", "status": status, "headers": raw})
        await self.send({"type": "http.response.body", "body": payload, "more_body": False})

    async def start_stream(self, headers: dict[str, str]) -> None:
        raw = [*_raw(headers), *_SSE_HEAD]
        await self.send({"type": "http.response.start", "status": 200, "headers": raw})

    def write(self, data: bytes) -> None:
        self._pending.append(data)

    async def drain(self) -> None:
        pending, self._pending = self._pending, []
        for data in pending:
            await self.send({"type": "http.response.body", "body": data, "more_body": True})

    async def end_stream(self, last: bytes) -> None:
        await self.drain()
        await self.send({"type": "http.response.body", "body": last, "more_body": False})

    def watch(self, scope: anyio.CancelScope) -> None:
        self._watcher = asyncio.create_task(_cancel_on_disconnect(self.receive, scope))

    def unwatch(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()


class DirectReply(AsgiReply):
    direct = True

    def __init__(self, scope: Scope, receive: Receive, send: Send, handle: Any) -> None:
        super().__init__(scope, receive, send)
        self._conn = handle.connection  # gateway.proxy.server.DataPlaneProtocol
        self._cycle = handle.cycle  # uvicorn's RequestResponseCycle of this request
        self._transport = handle.connection.transport
        self._on_gone: Callable[[], None] | None = None
        self._pause: Callable[[], None] | None = None

    async def json(self, status: int, body: Any, headers: dict[str, str]) -> None:
        """A whole answer in one socket write: its head and its body still go through ``send``
        (the request-id header, uvicorn's keep-alive bookkeeping), with uvicorn's cycle writing
        into a list meanwhile. Two writes cost two system calls, and each wakes the client."""
        cycle = self._cycle
        socket = cycle.transport
        gathered = cycle.transport = _Gathered(socket)
        try:
            await super().json(status, body, headers)
        finally:
            cycle.transport = socket
            gathered.pour()

    def write(self, data: bytes) -> None:
        if self._cycle.disconnected:
            return
        self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        if self._pause is not None and self._cycle.flow.write_paused:
            self._pause()  # the client reads slower than the engine writes: stop reading it

    async def drain(self) -> None:
        flow = self._cycle.flow
        if flow.write_paused and not self._cycle.disconnected:
            await flow.drain()

    def throttle(self, pause: Callable[[], None], resume: Callable[[], None]) -> None:
        """Pause the pushing source while the client's socket is full, resume once it drains."""
        self._pause = pause
        self._conn.on_writable = resume

    def watch(self, scope: anyio.CancelScope) -> None:
        if self._cycle.disconnected:
            scope.cancel()
            return
        self._on_gone = scope.cancel
        self._conn.watchers.add(scope.cancel)

    def unwatch(self) -> None:
        self._conn.on_writable = None
        self._pause = None
        if self._on_gone is not None:
            self._conn.watchers.discard(self._on_gone)
            self._on_gone = None


class _Gathered:
    """Stands in for the socket's transport in uvicorn's cycle while ``DirectReply.json`` sends:
    what the cycle writes is kept for one write (``pour``), made before a close the cycle asks."""

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._parts: list[bytes] = []

    def write(self, data: bytes) -> None:
        self._parts.append(data)

    def close(self) -> None:
        self.pour()
        self._transport.close()

    def is_closing(self) -> bool:
        return bool(self._transport.is_closing())

    def pour(self) -> None:
        parts, self._parts = self._parts, []
        if parts and not self._transport.is_closing():
            self._transport.write(b"".join(parts))


def reply_for(scope: Scope, receive: Receive, send: Send) -> AsgiReply:
    handle = scope.get("extensions", {}).get(DIRECT)
    if handle is not None:
        return DirectReply(scope, receive, send, handle)
    return AsgiReply(scope, receive, send)


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancel the flight when the client disconnects (its body has been read by then)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # the server cannot tell us: stop watching, the flight goes on
        log.exception("watching for the client's disconnect failed")
        return
    scope.cancel()
