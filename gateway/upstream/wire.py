"""HTTP/1.1 to the engines on asyncio protocols: kept-alive connections, httptools parsing, and a
response body pushed to its consumer as each read arrives (no task wakes up per read).

Lifecycle of one exchange (``WirePool.exchange``):

1. a connection: an idle kept-alive one to the same origin, or a new one within
   ``connect_timeout_s``;
2. the request goes out in one write; ``Exchange.head`` resolves with the status once the
   response head is parsed (or fails: the connection was refused, reset or timed out);
3. the body: bytes that arrive before a consumer is attached wait in the exchange;
   ``attach(sink)`` hands them over, then every later read goes to ``sink.data`` from the
   connection's own ``data_received``, and the end to ``sink.end`` (or the failure to
   ``sink.lost``); ``read_all`` collects a whole body instead;
4. ``release``: a complete response on a kept-alive connection returns it to the pool; anything
   else closes it (the engine sees the client go away). The pool keeps at most ``MAX_IDLE``
   idle connections per engine (one more is closed), and one the engine closes while idle
   leaves it at once: a burst of concurrent requests used to leave every connection it opened
   in the pool for good -- 8,000 after a ramp to 3,000 requests/s, with their sockets, parsers
   and events, which every later full garbage collection walked (165,000 objects where 7,000
   were before), slowing every request after it.

``read_timeout_s`` bounds every wait for the engine's next bytes (a slow but live stream is not
cut): one timer per exchange, re-armed only when it fires, compares the time of the last read.
A request whose kept-alive connection turns out closed by the engine before any byte of an answer
came back is sent once more on a fresh connection (the engine never read it).
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httptools

from contracts.deadline import running_timeout
from gateway.upstream.base import BodySink


class WireError(Exception):
    """The engine could not be reached, or the connection failed (the message names the class
    of failure, never content)."""


@dataclass(frozen=True, slots=True)
class Origin:
    host: str
    port: int
    tls: bool
    # the Host header's value, encoded once, not per request (the IDNA codec is Python code)
    host_header: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        default = 443 if self.tls else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        value = (host if self.port == default else f"{host}:{self.port}").encode("idna")
        object.__setattr__(self, "host_header", value)

    @classmethod
    def of(cls, base_url: str) -> Origin:
        parts = urlsplit(base_url)
        tls = parts.scheme == "https"
        return cls(parts.hostname or "", parts.port or (443 if tls else 80), tls)


class Exchange:
    """One request and its response on one connection."""

    __slots__ = (
        "conn",
        "head",
        "status",
        "content_type",
        "complete",
        "error",
        "_pending",
        "_sink",
        "_whole",
        "_got_bytes",
        "_lingering",
    )

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.head: asyncio.Future[int] = conn.loop.create_future()
        self.status = 0
        self.content_type = b""
        self.complete = False
        self.error: WireError | None = None
        self._pending: list[bytes] = []
        self._sink: BodySink | None = None
        self._whole: asyncio.Future[None] | None = None
        self._got_bytes = False
        self._lingering = False

    # -- the consumer's side -------------------------------------------------------------------

    def attach(self, sink: BodySink) -> None:
        """From now on, push the body to ``sink`` (what arrived before goes first)."""
        pending, self._pending = self._pending, []
        self._sink = sink
        for chunk in pending:
            sink.data(chunk)
        if self.error is not None:
            sink.lost(self.error)
        elif self.complete:
            sink.end()

    async def next_chunk(self) -> bytes:
        """The body's next bytes (b"" at its end): for the few reads before a sink is attached."""
        while not self._pending and not self.complete and self.error is None:
            waiter = self._whole = self.conn.loop.create_future()
            await waiter
        if self._pending:
            return self._pending.pop(0)
        if self.error is not None:
            raise self.error
        return b""

    async def read_all(self, limit: int | None = None) -> bytes | None:
        """The whole body (None when it grows past ``limit``: the rest is not read)."""
        parts: list[bytes] = []
        size = 0
        while chunk := await self.next_chunk():
            parts.append(chunk)
            size += len(chunk)
            if limit is not None and size > limit:
                return None
        return b"".join(parts)

    def pause(self) -> None:
        self.conn.pause()

    def resume(self) -> None:
        self.conn.resume()

    def release(self, *, linger: bool = False) -> None:
        """Done with the response: a complete one gives its connection back, else it closes --
        unless ``linger`` (the consumer read what it needed to its end, only the engine's last
        bytes may still be on their way): then the connection goes back once they came."""
        self._sink = None
        if linger and not self.complete and self.error is None:
            self._lingering = True
            return
        self.conn.finished(self, reuse=self.complete and self.error is None)

    # -- the connection's side -----------------------------------------------------------------

    def _body(self, chunk: bytes) -> None:
        self._got_bytes = True
        if self._lingering:
            return
        sink = self._sink
        if sink is not None:
            sink.data(chunk)
            return
        self._pending.append(chunk)
        self._wake()

    def _end(self) -> None:
        self.complete = True
        if self._lingering:
            self.conn.finished(self, reuse=True)
            return
        if self._sink is not None:
            self._sink.end()
        self._wake()

    def _fail(self, error: WireError) -> None:
        if self.complete or self.error is not None:
            return
        self.error = error
        if self._lingering:
            self.conn.finished(self, reuse=False)
            return
        if not self.head.done():
            self.head.set_exception(error)
        if self._sink is not None:
            self._sink.lost(error)
        self._wake()

    def _wake(self) -> None:
        waiter = self._whole
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class Connection(asyncio.Protocol):
    """One kept-alive connection to an engine; one exchange at a time."""

    def __init__(self, pool: WirePool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.exchange: Exchange | None = None
        self.used = False  # served an exchange before: it may have been closed while idle
        self.last_read = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._delimited = False  # the response says where its body ends
        self._keep_alive = False

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no asyncio subclass

    def data_received(self, data: bytes) -> None:
        self.last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._abort(WireError("invalid HTTP response"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._stop_timer()
        exchange = self.exchange
        if exchange is None:
            self.pool.forget(self)  # idle: closed by the engine (or by the pool when full)
        if exchange is not None and not exchange.complete:
            if exchange.head.done() and not self._delimited:
                exchange._end()  # a body without a length or chunks ends with the connection
            else:
                exchange._fail(WireError("connection lost"))

    # -- httptools callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name in (b"content-length", b"transfer-encoding"):
            self._delimited = True
        elif self.exchange is not None and name == b"content-type":
            self.exchange.content_type = value

    def on_headers_complete(self) -> None:
        self._keep_alive = self.parser.should_keep_alive()  # llhttp forgets it once complete
        exchange = self.exchange
        if exchange is not None and not exchange.head.done():
            exchange.status = self.parser.get_status_code()
            exchange.head.set_result(exchange.status)

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        if exchange is None:
            return
        sink = exchange._sink
        if sink is not None and not exchange._lingering:  # a pushed stream: straight on
            exchange._got_bytes = True
            sink.data(body)
        else:
            exchange._body(body)

    def on_message_complete(self) -> None:
        self._stop_timer()
        if self.exchange is not None:
            self.exchange._end()

    # -- the pool's side ---------------------------------------------------------------------

    def send(self, request: bytes, read_timeout_s: float) -> Exchange:
        assert self.transport is not None
        self.exchange = exchange = Exchange(self)
        self._delimited = False
        self.last_read = self.loop.time()
        self._timer = self.loop.call_later(read_timeout_s, self._check_read, read_timeout_s)
        self.transport.write(request)
        return exchange

    def _check_read(self, timeout_s: float) -> None:
        idle = self.loop.time() - self.last_read
        if idle >= timeout_s:
            self._timer = None
            self._abort(WireError("read timed out"))
        else:
            self._timer = self.loop.call_later(timeout_s - idle, self._check_read, timeout_s)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _abort(self, error: WireError) -> None:
        exchange = self.exchange
        if exchange is not None:
            exchange._fail(error)
        if self.transport is not None:
            self.transport.close()

    def pause(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    def finished(self, exchange: Exchange, *, reuse: bool) -> None:
        if self.exchange is not exchange:
            return
        self.exchange = None
        self._stop_timer()
        transport = self.transport
        if transport is None:
            return
        if reuse and self._keep_alive and not transport.is_closing():
            self.used = True
            transport.resume_reading()
            self.pool.give_back(self)
        else:
            transport.close()


MAX_IDLE = 100
"""Idle kept-alive connections kept per engine origin (aiohttp's connector keeps as many, in all):
enough for the usual concurrency; a burst opens more, and they close when it is over."""


class WirePool:
    """Idle kept-alive connections per engine origin (at most ``MAX_IDLE`` each)."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._idle: dict[Origin, list[Connection]] = {}
        self._tls: ssl.SSLContext | None = None

    async def exchange(self, origin: Origin, head: bytes, body: bytes) -> Exchange:
        """Send one request (``head`` ends with the blank line); the exchange once its response
        head has arrived (raises ``WireError`` when there is none)."""
        request = head + body
        for attempt in (0, 1):
            conn = await self._take(origin, fresh=attempt == 1)
            exchange = conn.send(request, self.read_timeout_s)
            try:
                await exchange.head
            except WireError:
                retry = attempt == 0 and conn.used and not exchange._got_bytes
                exchange.release()
                if not retry:
                    raise
                continue
            return exchange
        raise AssertionError("unreachable")

    def give_back(self, conn: Connection) -> None:
        idle = self._idle.setdefault(conn.origin, [])
        if len(idle) >= MAX_IDLE:
            assert conn.transport is not None
            conn.transport.close()
            return
        idle.append(conn)

    def forget(self, conn: Connection) -> None:
        """An idle connection the engine closed leaves the pool."""
        idle = self._idle.get(conn.origin)
        if idle is not None and conn in idle:
            idle.remove(conn)

    def idle(self, origin: Origin) -> int:
        """How many idle connections to ``origin`` the pool keeps."""
        return len(self._idle.get(origin, ()))

    async def _take(self, origin: Origin, *, fresh: bool) -> Connection:
        idle = self._idle.get(origin)
        while idle and not fresh:
            conn = idle.pop()
            if conn.transport is not None and not conn.transport.is_closing():
                return conn
        loop = asyncio.get_running_loop()
        tls = self._tls_context() if origin.tls else None
        try:
            async with running_timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: Connection(self, origin),
                    origin.host,
                    origin.port,
                    ssl=tls,
                    server_hostname=origin.host if tls is not None else None,
                )
        except TimeoutError as exc:
            raise WireError("connect timed out") from exc
        except OSError as exc:
            raise WireError(f"connect failed: {exc.__class__.__name__}") from exc
        return conn

    def _tls_context(self) -> ssl.SSLContext:
        if self._tls is None:
            self._tls = ssl.create_default_context()
        return self._tls

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()


def request_head(origin: Origin, path: str, headers: dict[str, str], length: int) -> bytes:
    """A POST head with a JSON body of ``length`` bytes (header values must be latin-1 and free
    of CR/LF: the gateway's own ids, trace context and an engine key)."""
    lines = [
        b"POST ",
        path.encode("ascii"),
        b" HTTP/1.1\r\nhost: ",
        origin.host_header,
        b"\r\ncontent-type: application/json\r\ncontent-length: ",
        str(length).encode(),
        b"\r\n",
    ]
    for name, value in headers.items():
        encoded = value.encode("latin-1")
        if b"\r" in encoded or b"\n" in encoded:
            raise ValueError(f"header {name} holds a line break")
        lines += [name.encode("latin-1"), b": ", encoded, b"\r\n"]
    lines.append(b"\r\n")
    return b"".join(lines)
