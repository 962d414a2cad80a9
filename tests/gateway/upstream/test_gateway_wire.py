"""The gateway's HTTP/1.1 client for engines (``gateway.upstream.wire``) against a real socket
server on 127.0.0.1: kept-alive connections are reused, a chunked body is pushed to its sink read
by read, a connection the engine closed while idle is replaced without the caller seeing it (and a
request that crossed the engine's close is sent again), a silent engine times out, and a response
left unfinished closes its connection."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import pytest

from gateway.upstream.wire import MAX_IDLE, Origin, WireError, WirePool, request_head

CHUNKED_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


class _Server(asyncio.Protocol):
    """Answers each request with ``script(self)``; counts connections and requests."""

    connections = 0
    requests: list[bytes] = []

    def __init__(self, script: Callable[[_Server], None]) -> None:
        self.script = script
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        type(self).connections += 1
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        type(self).requests.append(data)
        if b"\r\n\r\n" in data:
            self.script(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


class _Sink:
    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.ended = asyncio.get_running_loop().create_future()

    def data(self, chunk: bytes) -> None:
        self.chunks.append(chunk)

    def end(self) -> None:
        self.ended.set_result("end")

    def lost(self, error: Exception) -> None:
        self.ended.set_result(error)


async def _serve(script: Callable[[_Server], None]) -> AsyncIterator[tuple[Origin, list[_Server]]]:
    _Server.connections, _Server.requests = 0, []
    made: list[_Server] = []

    def factory() -> _Server:
        made.append(_Server(script))
        return made[-1]

    server = await asyncio.get_running_loop().create_server(factory, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield Origin.of(f"http://127.0.0.1:{port}"), made
    finally:
        server.close()


def _post(origin: Origin) -> bytes:
    return request_head(origin, "/v1/completions", {"x-kvguard-tenant": "t"}, 2)


def _ok(server: _Server) -> None:
    assert server.transport is not None
    server.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")


async def test_a_kept_alive_connection_serves_the_next_request() -> None:
    async for origin, _ in _serve(_ok):
        pool = WirePool(connect_timeout_s=5, read_timeout_s=5)
        for _ in range(3):
            exchange = await pool.exchange(origin, _post(origin), b"{}")
            assert (exchange.status, await exchange.read_all()) == (200, b"{}")
            exchange.release()
        assert _Server.connections == 1 and len(_Server.requests) == 3
        assert _Server.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:")
        assert b"x-kvguard-tenant: t\r\n" in _Server.requests[0]
        pool.close()


async def test_a_chunked_stream_is_pushed_read_by_read_in_order() -> None:
    def stream(server: _Server) -> None:
        assert server.transport is not None
        server.transport.write(CHUNKED_HEAD + _chunk(b"data: a\n\n"))
        loop = asyncio.get_running_loop()
        loop.call_later(0.02, server.transport.write, _chunk(b"data: b\n\n"))
        loop.call_later(0.04, server.transport.write, _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    async for origin, _ in _serve(stream):
        pool = WirePool(connect_timeout_s=5, read_timeout_s=5)
        exchange = await pool.exchange(origin, _post(origin), b"{}")
        assert exchange.content_type == b"text/event-stream"
        sink = _Sink()
        exchange.attach(sink)
        assert await asyncio.wait_for(sink.ended, 5) == "end"
        assert b"".join(sink.chunks) == b"data: a\n\ndata: b\n\ndata: [DONE]\n\n"
        assert len(sink.chunks) >= 2  # pushed as they came, not gathered at the end
        exchange.release()
        again = await pool.exchange(origin, _post(origin), b"{}")  # the connection was kept
        assert _Server.connections == 1
        again.release()
        pool.close()


async def test_a_connection_the_engine_closed_while_idle_is_replaced_unseen() -> None:
    def once_then_close(server: _Server) -> None:
        _ok(server)
        assert server.transport is not None
        server.transport.close()  # keeps no connection alive (as an idle timeout would)

    async for origin, made in _serve(once_then_close):
        pool = WirePool(connect_timeout_s=5, read_timeout_s=5)
        first = await pool.exchange(origin, _post(origin), b"{}")
        await first.read_all()
        first.release()  # back to the pool before the close arrives
        await asyncio.wait_for(made[0].closed, 5)
        second = await pool.exchange(origin, _post(origin), b"{}")
        assert (second.status, await second.read_all()) == (200, b"{}")
        second.release()
        assert _Server.connections == 2
        pool.close()


async def test_a_request_that_crosses_the_engines_close_goes_again_on_a_fresh_connection() -> None:
    """The engine's idle close and the next request cross: the engine closes the kept-alive
    connection without answering (it never read the request), and the pool sends the request once
    more on a new connection; the caller sees only the answer."""
    answered: set[int] = set()

    def one_answer_per_connection(server: _Server) -> None:
        assert server.transport is not None
        if id(server) in answered:
            server.transport.close()
            return
        answered.add(id(server))
        _ok(server)

    async for origin, _ in _serve(one_answer_per_connection):
        pool = WirePool(connect_timeout_s=5, read_timeout_s=5)
        first = await pool.exchange(origin, _post(origin), b"{}")
        await first.read_all()
        first.release()
        assert pool.idle(origin) == 1  # kept: the close comes only with the next request
        second = await pool.exchange(origin, _post(origin), b"{}")
        assert (second.status, await second.read_all()) == (200, b"{}")
        second.release()
        assert _Server.connections == 2 and len(_Server.requests) == 3
        pool.close()


async def test_a_silent_engine_times_out_and_an_unfinished_answer_closes_its_connection() -> None:
    def head_only(server: _Server) -> None:
        assert server.transport is not None
        server.transport.write(CHUNKED_HEAD)  # then nothing

    async for origin, made in _serve(head_only):
        pool = WirePool(connect_timeout_s=5, read_timeout_s=0.3)
        exchange = await pool.exchange(origin, _post(origin), b"{}")
        sink = _Sink()
        exchange.attach(sink)
        lost = await asyncio.wait_for(sink.ended, 5)
        assert isinstance(lost, WireError) and "timed out" in str(lost)
        exchange.release()
        await asyncio.wait_for(made[0].closed, 5)  # the engine sees the client go away
        pool.close()


async def test_an_unreachable_engine_is_a_wire_error() -> None:
    async for served, _ in _serve(_ok):
        origin = served
    pool = WirePool(connect_timeout_s=2, read_timeout_s=2)
    with pytest.raises(WireError, match="connect failed"):
        await pool.exchange(origin, _post(origin), b"{}")


async def test_a_connect_while_this_loop_stood_still_is_not_a_timeout() -> None:
    """The gateway's own loop stands still past the connect timeout (a garbage collection, a CPU
    taken away) while the engine accepts at once: the exchange goes on."""
    async for origin, _ in _serve(_ok):
        pool = WirePool(connect_timeout_s=0.3, read_timeout_s=5)
        asyncio.get_running_loop().call_soon(time.sleep, 0.5)
        exchange = await pool.exchange(origin, _post(origin), b"{}")
        assert (exchange.status, await exchange.read_all()) == (200, b"{}")
        exchange.release()
        pool.close()


async def test_a_burst_leaves_at_most_max_idle_connections_open() -> None:
    """250 requests at once open 250 connections; when they are answered, the pool keeps
    ``MAX_IDLE`` of them and closes the rest (the engine sees them close). Before, every one
    stayed in the pool for good, with its socket, parser and events."""
    loop = asyncio.get_running_loop()
    answer, all_in = loop.create_future(), loop.create_future()
    waiting: list[_Server] = []

    def later(server: _Server) -> None:  # answers once all 250 requests are in
        waiting.append(server)
        if len(waiting) == 250:
            all_in.set_result(None)
        answer.add_done_callback(lambda _: _ok(server))

    async for origin, servers in _serve(later):
        pool = WirePool(connect_timeout_s=5, read_timeout_s=5)
        burst = [
            asyncio.ensure_future(pool.exchange(origin, _post(origin), b"{}")) for _ in range(250)
        ]
        await asyncio.wait_for(all_in, 10)
        answer.set_result(None)
        for exchange in await asyncio.gather(*burst):
            assert await exchange.read_all() == b"{}"
            exchange.release()
        assert pool.idle(origin) == MAX_IDLE and len(servers) == 250
        closed = [s.closed for s in servers]
        done, _ = await asyncio.wait(closed, timeout=5)
        assert len(done) == 250 - MAX_IDLE  # the rest were closed: the engine saw it
        pool.close()


async def test_an_idle_connection_the_engine_closes_leaves_the_pool() -> None:
    """The engine closes a kept-alive connection (its keep-alive timeout): it leaves the pool at
    once, instead of staying in it, dead, until a request happens to take it."""
    async for origin, servers in _serve(_ok):
        pool = WirePool(connect_timeout_s=5, read_timeout_s=5)
        exchange = await pool.exchange(origin, _post(origin), b"{}")
        assert await exchange.read_all() == b"{}"
        exchange.release()
        assert pool.idle(origin) == 1
        (conn,) = pool._idle[origin]
        lost = asyncio.get_running_loop().create_future()
        connection_lost = conn.connection_lost

        def seen_lost(exc: Exception | None, was=connection_lost, seen=lost) -> None:  # type: ignore[no-untyped-def]
            was(exc)
            seen.set_result(None)

        conn.connection_lost = seen_lost  # type: ignore[method-assign]
        (server,) = servers
        assert server.transport is not None
        server.transport.close()  # the engine's keep-alive timeout
        await asyncio.wait_for(lost, 5)
        assert pool.idle(origin) == 0
        pool.close()
