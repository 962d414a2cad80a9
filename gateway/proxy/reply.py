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
  client goes away or can take more. A stream's head and its final bytes still go through
  ``send`` (the request-id headers, uvicorn's keep-alive and pipelining bookkeeping); a whole
  answer is written below ASGI too, head and body in one socket write, with uvicorn's
  bookkeeping done as its ``send`` does it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import orjson
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from gateway.api.request_ids import id_headers

log = logging.getLogger("kvguard.gateway.proxy")

DIRECT = "kvguard.direct"  # the scope extension the gateway's protocol sets (its connection)
_SSE_HEAD = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
]
_CHUNKED = (b"transfer-encoding", b"chunked")


class ClientGone(Exception):
    """Sending to the client failed: it went away."""


class Watch:
    """Cancels a flight's task when its client goes away: once, with asyncio's own cancellation,
    so the flight's cleanup (``finally``) awaits as usual, and never inside ``held`` (a part that
    must finish: reporting a cut, closing the engine's stream), where it waits for its end.
    ``claims`` tells the flight's own cancellation from anyone else's (the server's, at
    shutdown)."""

    __slots__ = ("task", "fired", "_held", "_waiting")

    def __init__(self, task: asyncio.Task[Any]) -> None:
        self.task = task
        self.fired = False
        self._held = 0
        self._waiting = False

    def cancel(self) -> None:
        if self.fired:
            return
        if self._held:
            self._waiting = True
            return
        self.fired = True
        self.task.cancel()

    def claims(self) -> bool:
        """Called on a ``CancelledError`` in the task: whether it is this watch's alone (then the
        task is no longer cancelling); False: someone else cancelled too, it must propagate."""
        return self.fired and self.task.uncancel() == 0

    @contextmanager
    def held(self) -> Iterator[None]:
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
            if not self._held and self._waiting:
                self._waiting = False
                self.cancel()


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

    def watch(self, watch: Watch) -> None:
        self._watcher = asyncio.create_task(_cancel_on_disconnect(self.receive, watch))

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
        """A whole answer in one socket write, below ASGI. Through ``send`` a whole answer crossed
        the request-id middleware and uvicorn's cycle twice, validating every header with a
        regular expression each time."""
        payload = orjson.dumps(body)
        own = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(payload))]
        head = await self._start(status, [*own, *_raw(headers)])
        if head is not None:
            self._complete(head if self.scope["method"] == "HEAD" else head + payload)

    async def start_stream(self, headers: dict[str, str]) -> None:
        """A stream's head, below ASGI as ``json``'s; its body is HTTP chunks (``write``)."""
        head = await self._start(200, [*_raw(headers), *_SSE_HEAD, _CHUNKED])
        if head is not None:
            cycle = self._cycle
            cycle.chunked_encoding, cycle.expected_content_length = True, 0
            cycle.transport.write(head)

    async def end_stream(self, last: bytes) -> None:
        """The stream's last bytes and the end of its chunks, in one socket write."""
        await self.drain()
        if self._cycle.disconnected or self._cycle.response_complete:
            return  # as uvicorn's send: nobody is left to answer
        self._complete((b"%x\r\n%b\r\n" % (len(last), last) if last else b"") + b"0\r\n\r\n")

    async def _start(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """The head ``send`` would write for ``http.response.start`` (uvicorn's default headers,
        then ``headers``, then the request-id headers; ``connection: close`` on a connection that
        is not kept), with its bookkeeping done (the access log line, keep-alive); None when the
        client is gone (as uvicorn's ``send``: nobody is left to answer)."""
        cycle = self._cycle
        if cycle.flow.write_paused and not cycle.disconnected:
            await cycle.flow.drain()
        if cycle.disconnected:
            return None
        if cycle.response_started:
            raise RuntimeError("the response has started")
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        if cycle.access_log and cycle.access_logger.isEnabledFor(logging.INFO):
            scope = cycle.scope  # the same scope, as uvicorn types it
            cycle.access_logger.info(
                '%s - "%s %s HTTP/%s" %d',
                get_client_addr(scope),
                scope["method"],
                get_path_with_query_string(scope),
                scope["http_version"],
                status,
            )
        lines = [*cycle.default_headers, *headers, *id_headers(self.scope)]
        written, cycle.keep_alive = _head(status, lines, keep_alive=cycle.keep_alive)
        return written

    def _complete(self, data: bytes) -> None:
        """The answer's last bytes, then uvicorn's end of a response: the connection closed if it
        is not kept, else the next pipelined request served."""
        cycle = self._cycle
        cycle.transport.write(data)
        cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            cycle.transport.close()
        cycle.on_response()

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

    def watch(self, watch: Watch) -> None:
        if self._cycle.disconnected:
            watch.cancel()
            return
        self._on_gone = watch.cancel
        self._conn.watchers.add(watch.cancel)

    def unwatch(self) -> None:
        self._conn.on_writable = None
        self._pause = None
        if self._on_gone is not None:
            self._conn.watchers.discard(self._on_gone)
            self._on_gone = None


def _head(
    status: int, headers: list[tuple[bytes, bytes]], *, keep_alive: bool
) -> tuple[bytes, bool]:
    """The status line and headers of a whole answer as uvicorn's ``send`` writes them (names
    lower-case; one it would refuse is a gateway bug: a 500), and whether the connection is kept:
    not when it was not to be, nor when the answer says ``connection: close``; the head says
    ``connection: close`` whenever it is not."""
    names = b"".join(name for name, _ in headers)
    if HEADER_RE.search(names) or HEADER_VALUE_RE.search(b"\t".join(v for _, v in headers)):
        raise RuntimeError("invalid HTTP header")
    lines = [STATUS_LINE[status]]
    said_close = False
    for name, value in headers:
        name = name.lower()
        if name == b"connection":
            said_close = said_close or b"close" in [t.strip().lower() for t in value.split(b",")]
        lines += [name, b": ", value, b"\r\n"]
    if not keep_alive and not said_close:
        lines.append(b"connection: close\r\n")
    lines.append(b"\r\n")
    return b"".join(lines), keep_alive and not said_close


def reply_for(scope: Scope, receive: Receive, send: Send) -> AsgiReply:
    handle = scope.get("extensions", {}).get(DIRECT)
    if handle is not None:
        return DirectReply(scope, receive, send, handle)
    return AsgiReply(scope, receive, send)


async def _cancel_on_disconnect(receive: Receive, watch: Watch) -> None:
    """Cancel the flight when the client disconnects (its body has been read by then)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # the server cannot tell us: stop watching, the flight goes on
        log.exception("watching for the client's disconnect failed")
        return
    watch.cancel()
