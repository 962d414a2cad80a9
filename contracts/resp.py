"""A lean Redis client for the request path: one connection, commands pipelined on it, replies
matched in order (Redis answers a connection's commands in the order they came). The gateway's
limiter (``gateway.limits.redis_limiter``) and the canary's marker records
(``canary.records.RedisRecordStore``) use it.

Why not redis-py here: its asyncio client checks a connection out of a pool, checks its health,
packs the command and parses the reply through several layers on every call -- about a quarter of
a request's CPU in the gateway's profile (two calls per request: admit, release). This client
writes a command's bytes and awaits one future; a reply resolves the oldest waiting command.

Lifecycle of a connection: opened on first use (bounded by ``timeout_s`` of the loop's running
time: ``contracts.deadline``), AUTH and SELECT as the URL asks -> commands written as they come,
each reply resolving the oldest waiting one -> closed on a server close, a protocol error or a
command that waited past ``timeout_s``: every waiting command then fails (``ConnectionError`` or
``TimeoutError``, both ``OSError``) and the next call opens a new connection. A timed-out command
may still run on the server: the caller decides what that means (the limiter abandons the admit,
``gateway.limits.redis_limiter``).

A call that fails because its connection broke (not a timeout) is tried once more on a fresh one:
after an outage the old connection is dead and would fail one call with a spurious error. The
caller must accept that a command may then run twice (the limiter's scripts do).

URLs: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` (TLS) and
``unix://[[user]:password@]/path[?db=N]``, as redis-py reads them.
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from contracts.deadline import running_timeout

Arg = bytes | str | int
Reply = bytes | int | list[Any] | None


class RespError(Exception):
    """An error reply from Redis (``-ERR ...``, ``-NOSCRIPT ...``)."""


class _Incomplete(Exception):
    pass


def encode(args: Sequence[Arg]) -> bytes:
    """A command as a RESP array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(out)


class RespReader:
    """RESP2 replies out of a byte stream: ``feed`` bytes, ``get`` a reply or ``None`` when the
    next one is not complete yet. Error replies come back as ``RespError`` values."""

    def __init__(self) -> None:
        self._buf = b""
        self._pos = 0

    def feed(self, data: bytes) -> None:
        self._buf = self._buf[self._pos :] + data if self._pos else self._buf + data
        self._pos = 0

    def get(self) -> tuple[Reply | RespError] | None:
        """``(reply,)`` or ``None`` (the tuple tells a nil reply from no reply)."""
        if self._pos >= len(self._buf):
            return None
        try:
            value, self._pos = self._parse(self._pos)
        except _Incomplete:
            return None
        return (value,)

    def _line(self, pos: int) -> tuple[bytes, int]:
        end = self._buf.find(b"\r\n", pos)
        if end < 0:
            raise _Incomplete
        return self._buf[pos:end], end + 2

    def _parse(self, pos: int) -> tuple[Any, int]:
        kind = self._buf[pos : pos + 1]
        line, pos = self._line(pos + 1)
        if kind == b":":
            return int(line), pos
        if kind == b"$":
            size = int(line)
            if size < 0:
                return None, pos
            if len(self._buf) < pos + size + 2:
                raise _Incomplete
            return self._buf[pos : pos + size], pos + size + 2
        if kind == b"*":
            count = int(line)
            if count < 0:
                return None, pos
            items = []
            for _ in range(count):
                item, pos = self._parse(pos)
                items.append(item)
            return items, pos
        if kind == b"+":
            return line, pos
        if kind == b"-":
            return RespError(line.decode("utf-8", "replace")), pos
        raise ValueError(f"not a RESP reply (type byte {kind!r})")


@dataclass(frozen=True, slots=True)
class Address:
    host: str  # "" for a unix socket (at ``path``)
    port: int
    path: str | None
    tls: bool
    username: str | None
    password: str | None
    db: int

    @classmethod
    def of(cls, url: str) -> Address:
        parts = urlsplit(url)
        username = unquote(parts.username) if parts.username else None
        password = unquote(parts.password) if parts.password else None
        query = parse_qs(parts.query)
        if parts.scheme == "unix":
            db = int(query.get("db", ["0"])[0])
            return cls("", 0, parts.path, False, username, password, db)
        if parts.scheme not in ("redis", "rediss"):
            raise ValueError("a Redis URL starts with redis://, rediss:// or unix://")
        db_text = parts.path.lstrip("/") or query.get("db", ["0"])[0]
        return cls(
            parts.hostname or "localhost",
            parts.port or 6379,
            None,
            parts.scheme == "rediss",
            username,
            password,
            int(db_text),
        )


class _Connection(asyncio.Protocol):
    """One connection: writes commands, resolves their futures in order, fails them all at once."""

    def __init__(self, timeout_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self._timeout = timeout_s
        self._transport: asyncio.Transport | None = None
        self._reader = RespReader()
        self._waiting: deque[tuple[asyncio.Future[Any], float]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionError("the Redis connection closed"))

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        reader.feed(data)
        waiting = self._waiting
        while True:
            try:
                got = reader.get()
            except ValueError:
                self._fail(ConnectionError("Redis sent something that is not RESP"))
                return
            if got is None:
                return
            if not waiting:
                self._fail(ConnectionError("Redis replied to no command"))
                return
            future = waiting.popleft()[0]
            if not future.done():  # done: its caller was cancelled; the reply is dropped
                future.set_result(got[0])

    def send(self, payload: bytes, count: int = 1) -> list[asyncio.Future[Any]]:
        """Write ``count`` commands (already encoded, in ``payload``); their replies' futures."""
        if self.closed or self._transport is None:
            raise ConnectionError("the Redis connection is closed")
        self._transport.write(payload)
        deadline = self._loop.time() + self._timeout
        futures = [self._loop.create_future() for _ in range(count)]
        self._waiting.extend((future, deadline) for future in futures)
        if self._timer is None:
            self._timer = self._loop.call_at(deadline, self._check)
        return futures

    def _check(self) -> None:
        """The oldest waiting command past its deadline fails every waiting one (a later reply
        could not be told apart); else look again at its deadline."""
        self._timer = None
        if not self._waiting:
            return
        deadline = self._waiting[0][1]
        if self._loop.time() >= deadline:
            self._fail(TimeoutError(f"Redis did not answer within {self._timeout:g} s"))
        else:
            self._timer = self._loop.call_at(deadline, self._check)

    def _fail(self, exc: OSError) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting, self._waiting = self._waiting, deque()
        for future, _ in waiting:
            if not future.done():
                future.set_exception(exc)
        if self._transport is not None:
            self._transport.abort()


class RespClient:
    def __init__(self, url: str, *, timeout_s: float) -> None:
        self._address = Address.of(url)
        self._timeout = timeout_s
        self._conn: _Connection | None = None
        self._lock: asyncio.Lock | None = None

    async def execute(self, *args: Arg) -> Reply:
        """One command's reply; raises ``RespError`` for an error reply, ``OSError`` otherwise."""
        (reply,) = await self.pipeline([args])
        if isinstance(reply, RespError):
            raise reply
        return reply

    async def pipeline(self, commands: Sequence[Sequence[Arg]]) -> list[Reply | RespError]:
        """Several commands in one write; each reply (or ``RespError``) in order."""
        payload = b"".join(encode(command) for command in commands)
        for attempt in range(2):
            conn = await self._connection()
            futures = conn.send(payload, len(commands))
            try:
                return [await future for future in futures]
            except ConnectionError:
                _retrieve(futures)
                if attempt:
                    raise
            except BaseException:
                _retrieve(futures)
                raise
        raise AssertionError("unreachable")

    async def _connection(self) -> _Connection:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            conn = self._conn
            if conn is None or conn.closed:
                conn = self._conn = await self._connect()
            return conn

    async def _connect(self) -> _Connection:
        loop = asyncio.get_running_loop()
        a = self._address
        try:
            async with running_timeout(self._timeout):
                if a.path is not None:
                    _, conn = await loop.create_unix_connection(
                        lambda: _Connection(self._timeout), a.path
                    )
                else:
                    context = ssl.create_default_context() if a.tls else None
                    _, conn = await loop.create_connection(
                        lambda: _Connection(self._timeout), a.host, a.port, ssl=context
                    )
        except TimeoutError as exc:
            raise ConnectionError("Redis did not accept a connection in time") from exc
        setup: list[list[Arg]] = []
        if a.password is not None:
            setup.append(["AUTH", *([a.username] if a.username else []), a.password])
        if a.db:
            setup.append(["SELECT", a.db])
        if setup:
            payload = b"".join(encode(command) for command in setup)
            for reply in [await f for f in conn.send(payload, len(setup))]:
                if isinstance(reply, RespError):
                    conn._fail(ConnectionError(f"Redis refused the connection setup: {reply}"))
                    raise reply
        return conn

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            conn._fail(ConnectionError("the Redis client closed"))


def _retrieve(futures: list[asyncio.Future[Any]]) -> None:
    """Mark the failures of a pipeline's other commands as seen (they share one cause)."""
    for future in futures:
        if future.done() and not future.cancelled():
            future.exception()


class Script:
    """A Lua script run by its SHA1 (``EVALSHA``), loaded once when Redis does not know it."""

    def __init__(self, client: RespClient, source: str) -> None:
        self._client = client
        self._source = source.encode()
        self.sha = hashlib.sha1(self._source).hexdigest()

    def command(self, keys: Sequence[Arg], args: Sequence[Arg]) -> list[Arg]:
        return ["EVALSHA", self.sha, len(keys), *keys, *args]

    async def __call__(self, keys: Sequence[Arg], args: Sequence[Arg]) -> Reply:
        command = self.command(keys, args)
        try:
            return await self._client.execute(*command)
        except RespError as exc:
            if not str(exc).startswith("NOSCRIPT"):
                raise
        await self.load()
        return await self._client.execute(*command)

    async def load(self) -> None:
        await self._client.execute("SCRIPT", "LOAD", self._source)
