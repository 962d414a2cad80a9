"""The HTTP edge every kvguard server shares: OpenAI-style error bodies, the body guard, and the
uvicorn protocol that bounds how long and how large a request head may be.

The engine and the gateway render client mistakes the same way — a 4xx with
``{"error": {"message", "type", "param", "code"}}`` and a stable ``code`` — so both import these
pieces instead of keeping copies that could drift.

A request's life at the edge, with the bound that applies in each phase:
1. connection open, head arriving (request line + headers): ``GuardedHttpProtocol`` — the whole
   head within ``header_timeout_s`` (408, then closed) and ``max_head_bytes`` (431, then closed);
   a head the parser refuses (e.g. a bare CR or LF in a header value) is a 400. uvicorn alone arms
   no timer before the first response, so a slowloris client would hold a connection forever;
2. body arriving: ``BodyGuardMiddleware`` — the whole body within ``body_timeout_s`` (408) and
   ``max_bytes`` (413), both answered with ``connection: close`` so uvicorn stops reading the
   rest; a body that is not UTF-8 is a 400;
3. the app; then uvicorn's keep-alive timer while idle, and back to 1 for the next request.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import uvicorn
from fastapi.exceptions import RequestValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from contracts import grid

DEFAULT_MAX_HEAD_BYTES = 64 * 1024
_HEAD_END = b"\r\n\r\n"
_REASONS = {400: "Bad Request", 408: "Request Timeout", 431: "Request Header Fields Too Large"}


def error_body(
    message: str, *, code: str, type_: str = "invalid_request_error", param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A one-line message and the offending parameter of a request validation error."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    kind = first.get("type")
    if kind == "json_invalid":
        return "request body is not valid JSON", None
    if kind == "extra_forbidden":
        return f"unknown field '{param}'", param
    if kind == "missing" and param is None:
        return "request body is required", None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


class BodyGuardMiddleware:
    """Refuses bodies over a size limit (413), too slow (408) or not UTF-8 (400), up front.

    Reads the body once, bounded, before any route sees it: a client announcing or streaming more
    than ``max_bytes`` gets a 413 without the server buffering the excess, and one that has not
    sent its whole body within ``body_timeout_s`` gets a 408 (a trickling client must not hold a
    connection and a buffer for ever).
    """

    def __init__(
        self, app: ASGIApp, *, max_bytes: int, body_timeout_s: float | None = None
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send, 413, "request body too large", "body_too_large")
            return
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body = await self._read(receive)
        except TimeoutError:
            message = f"request body not received within {self.body_timeout_s:g} s"
            await self._reject(send, 408, message, "request_timeout")
            return
        if body is None:  # the client went away
            return
        if len(body) > self.max_bytes:
            await self._reject(send, 413, "request body too large", "body_too_large")
            return
        if not body.isascii() and not _utf8(body):  # ASCII is UTF-8, without a decode
            await self._reject(send, 400, "request body is not valid UTF-8", "invalid_encoding")
            return
        await self.app(scope, _replay(body, receive), send)

    async def _read(self, receive: Receive) -> bytes | None:
        """The body, or its first ``max_bytes + 1`` bytes (then the rest is never read); a body
        that came in one message is that message's, not a copy."""
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        first: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if not more:
            return first
        body = bytearray(first)
        while more and len(body) <= self.max_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
        return bytes(body)

    async def _reject(self, send: Send, status: int, message: str, code: str) -> None:
        if status == 413:
            message = f"{message} (limit {self.max_bytes} bytes)"
        payload = json.dumps(error_body(message, code=code)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ]
        if status in (408, 413):  # the rest of the body is unread: uvicorn must not wait for it
            headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _utf8(body: bytes) -> bool:
    try:
        body.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _replay(body: bytes, downstream: Receive) -> Receive:
    """Hand the buffered body to the app once, then pass through (so disconnects still arrive)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await downstream()

    return receive


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline and a size bound on every request head.

    The head timer starts when the connection opens (and again when a kept-alive connection
    begins its next request) and stops when the head is complete; uvicorn's own keep-alive timer
    covers the idle time between requests. Subclasses set the two class attributes
    (``guarded_protocol``).
    """

    header_timeout_s: float = 15.0
    max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
    # per connection; set again in connection_made
    _head_timer: asyncio.TimerHandle | None = None
    _refused: bool = False
    _reading_head: bool = False
    _head_bytes: int = 0
    _tail: bytes = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._refused = False
        self._begin_head()
        super().connection_made(transport)  # type: ignore[arg-type]

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._reading_head:
            # Count only the bytes up to the end of the head: a body may share the packet.
            window = self._tail + data
            end = window.find(_HEAD_END)
            self._head_bytes += len(data) if end < 0 else max(0, end + 4 - len(self._tail))
            self._tail = window[-3:]
            if self._head_bytes > self.max_head_bytes:
                message = f"request head larger than {self.max_head_bytes} bytes"
                self._refuse(431, message, "headers_too_large")
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        if not self._reading_head:
            # The next request on a kept-alive connection: its first read was parsed before this
            # call and is not counted, so its head may reach max_head_bytes plus one read.
            self._begin_head()
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._stop_head_timer()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's own answer to an unparsable head is text/plain; ours is the usual error body
        self._refuse(400, "invalid HTTP request", "invalid_http_request")

    def _begin_head(self) -> None:
        self._reading_head = True
        self._head_bytes = 0
        self._tail = b""
        self._stop_head_timer()
        self._head_timer = asyncio.get_running_loop().call_later(
            self.header_timeout_s, self._head_timed_out
        )

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        message = f"request head not received within {self.header_timeout_s:g} s"
        self._refuse(408, message, "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer once with an OpenAI-style error and close: no app has seen this request."""
        self._stop_head_timer()
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        payload = json.dumps(error_body(message, code=code)).encode()
        head = (
            f"HTTP/1.1 {status} {_REASONS[status]}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(payload)}\r\nconnection: close\r\n\r\n"
        )
        self.transport.write(head.encode("ascii") + payload)
        self.transport.close()


def guarded_protocol(
    *, header_timeout_s: float, max_head_bytes: int = DEFAULT_MAX_HEAD_BYTES
) -> type[GuardedHttpProtocol]:
    """A ``GuardedHttpProtocol`` class with these bounds (uvicorn makes one per connection)."""
    attrs = {"header_timeout_s": header_timeout_s, "max_head_bytes": max_head_bytes}
    return type("GuardedHttpProtocol", (GuardedHttpProtocol,), attrs)


SERVER_KEEP_ALIVE_S = 5
"""How long every kvguard server keeps an idle connection open (uvicorn's default, set here)."""
CLIENT_KEEP_ALIVE_S = SERVER_KEEP_ALIVE_S / 2
"""How long a kvguard client keeps an idle connection to a server: well below the server's (a
kvguard server's, and an engine's: vLLM's and SGLang's keep idle connections uvicorn's 5 s), so no
request goes out on a connection the server is closing at that moment. With both at 5 s, the
server's close and a request could cross: the client read a reset (``ReadError``), and decode lost
a handoff to prefill that way under load (``tests/backend/disagg``); and the gateway's capacity
poll, every 5 s, went out within milliseconds of each engine's close every round (a failed poll
blocks the engine until the next)."""


def server_config(
    app: ASGIApp,
    *,
    host: str,
    port: int,
    header_timeout_s: float,
    log_level: str = "warning",
    lifespan: Literal["auto", "on", "off"] = "auto",
) -> uvicorn.Config:
    """How every kvguard server runs under uvicorn: the guarded protocol, bounded heads, and the
    TCP peer as the client (uvicorn would otherwise take ``X-Forwarded-For`` from any peer on
    127.0.0.1 as the client's address; the gateway believes forwarded headers only from the
    proxies its operator lists: ``gateway.deps.client_address``)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan=lifespan,
        http=guarded_protocol(header_timeout_s=header_timeout_s),
        proxy_headers=False,
        timeout_keep_alive=SERVER_KEEP_ALIVE_S,
    )


class EdgeServer(uvicorn.Server):
    """uvicorn's server, woken once a second instead of ten times.

    uvicorn's main loop sleeps 100 ms at a time to notice an exit signal, and refreshes its
    ``date`` header every tenth wake-up: ten wake-ups a second of an idle server, each an event-
    loop iteration, on the core the data plane runs on. Here the loop wakes once a second (the
    ``date`` header's rate, the same refresh) and at once when told to exit: setting
    ``should_exit`` (uvicorn's signal handler does, as do tests) wakes it through the event loop's
    thread-safe call, safe from a signal handler."""

    tick_s = 1.0

    def __init__(self, config: uvicorn.Config) -> None:
        self._exit_now: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._exit = False
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self._exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._exit = value
        if value and self._exit_now is not None:
            loop, event = self._exit_now
            loop.call_soon_threadsafe(event.set)

    async def main_loop(self) -> None:
        event = asyncio.Event()
        self._exit_now = (asyncio.get_running_loop(), event)
        try:
            # on_tick refreshes the date header when its count is a multiple of 10 (a second of
            # uvicorn's 100 ms ticks): every tick here is a second
            while not await self.on_tick(0):
                try:
                    async with asyncio.timeout_at(grid.deadline(self.tick_s)):
                        await event.wait()
                except TimeoutError:
                    pass
        finally:
            self._exit_now = None  # no wake-up is owed to a loop that may close
