"""The limiter's lean Redis client (contracts.resp): RESP read exactly however the bytes are
cut, replies matched to commands in order under concurrency, scripts loaded when Redis forgot
them, and every failure an ``OSError`` that leaves the next call a fresh connection."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from contracts.resp import Address, RespClient, RespError, RespReader, Script, encode

REPLIES = [
    (b":42\r\n", 42),
    (b"$3\r\nabc\r\n", b"abc"),
    (b"$0\r\n\r\n", b""),
    (b"$-1\r\n", None),
    (b"*-1\r\n", None),
    (b"+OK\r\n", b"OK"),
    (b"*3\r\n:1\r\n$6\r\ntok\r\nn\r\n:-1\r\n", [1, b"tok\r\nn", -1]),
    (b"*2\r\n*1\r\n:7\r\n*0\r\n", [[7], []]),
]


@given(st.lists(st.sampled_from(range(len(REPLIES))), min_size=1, max_size=12), st.data())
def test_reader_reads_replies_however_the_bytes_are_cut(picks: list[int], data) -> None:
    stream = b"".join(REPLIES[i][0] for i in picks)
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(stream) - 1)), max_size=8)))
    reader = RespReader()
    got = []
    start = 0
    for end in [*cuts, len(stream)]:
        reader.feed(stream[start:end])
        start = end
        while (reply := reader.get()) is not None:
            got.append(reply[0])
    assert got == [REPLIES[i][1] for i in picks]


def test_reader_error_reply_is_a_value() -> None:
    reader = RespReader()
    reader.feed(b"-NOSCRIPT No matching script\r\n:1\r\n")
    first = reader.get()
    assert first is not None and isinstance(first[0], RespError)
    assert str(first[0]).startswith("NOSCRIPT")
    assert reader.get() == (1,)
    assert reader.get() is None


def test_encode_is_a_bulk_string_array() -> None:
    assert encode(["SET", b"k", 12]) == b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n12\r\n"


def test_addresses_read_like_redis_py() -> None:
    a = Address.of("redis://user:p%40ss@example.org:6380/4")
    assert (a.host, a.port, a.username, a.password, a.db, a.tls) == (
        "example.org",
        6380,
        "user",
        "p@ss",
        4,
        False,
    )
    assert Address.of("rediss://h").tls and Address.of("rediss://h").port == 6379
    unix = Address.of("unix:///run/redis.sock?db=2")
    assert (unix.path, unix.db, unix.host) == ("/run/redis.sock", 2, "")
    with pytest.raises(ValueError):
        Address.of("http://h")


async def test_concurrent_commands_get_their_own_replies(redis_url: str) -> None:
    client = RespClient(redis_url, timeout_s=2)
    try:
        await asyncio.gather(*(client.execute("SET", f"k{i}", i) for i in range(200)))
        got = await asyncio.gather(*(client.execute("GET", f"k{i}") for i in range(200)))
        assert got == [str(i).encode() for i in range(200)]
        with pytest.raises(RespError):
            await client.execute("INCR", "no", "such", "arity")
        assert await client.execute("PING") == b"PONG"  # an error reply breaks nothing
    finally:
        await client.close()


async def test_selects_the_database_in_the_url(redis_url: str) -> None:
    client = RespClient(redis_url.rsplit("/", 1)[0] + "/3", timeout_s=2)
    try:
        await client.execute("SET", "in-three", "1")
    finally:
        await client.close()
    other = redis.Redis.from_url(redis_url.rsplit("/", 1)[0] + "/3")
    try:
        assert other.get("in-three") == b"1"
        other.flushdb()
    finally:
        other.close()


async def test_a_script_redis_forgot_is_loaded_again(redis_url: str) -> None:
    client = RespClient(redis_url, timeout_s=2)
    script = Script(client, "return tonumber(ARGV[1]) + 1")
    try:
        assert await script([], [41]) == 42
        await client.execute("SCRIPT", "FLUSH")
        assert await script([], [1]) == 2
    finally:
        await client.close()


@contextlib.asynccontextmanager
async def fake_server(on_data):
    """A TCP server whose connections call ``on_data(transport, data)``; yields its URL."""
    transports: list[asyncio.Transport] = []

    class Proto(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.transport = transport
            transports.append(transport)

        def data_received(self, data: bytes) -> None:
            on_data(self.transport, data)

    server = await asyncio.get_running_loop().create_server(Proto, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"redis://127.0.0.1:{port}/0", transports
    finally:
        server.close()
        for transport in transports:
            transport.abort()


async def test_a_silent_server_times_out_and_the_next_call_reconnects() -> None:
    answering = False

    def on_data(transport, data: bytes) -> None:
        if answering:
            transport.write(b"+PONG\r\n" * data.count(b"PING"))

    async with fake_server(on_data) as (url, transports):
        client = RespClient(url, timeout_s=0.2)
        results = await asyncio.gather(
            *(client.execute("PING") for _ in range(3)), return_exceptions=True
        )
        assert all(isinstance(r, TimeoutError) for r in results)
        answering = True
        assert await client.execute("PING") == b"PONG"
        assert len(transports) == 2  # the silent connection was dropped, a new one opened
        await client.close()


async def test_a_connection_the_server_dropped_is_replaced_once() -> None:
    calls = 0

    def on_data(transport, data: bytes) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            transport.abort()  # as a restarted Redis would: the command never answered
        else:
            transport.write(b":1\r\n")

    async with fake_server(on_data) as (url, transports):
        client = RespClient(url, timeout_s=1)
        assert await client.execute("INCR", "x") == 1
        assert len(transports) == 2
        await client.close()


async def test_nobody_listening_is_an_os_error() -> None:
    server = await asyncio.get_running_loop().create_server(asyncio.Protocol, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    client = RespClient(f"redis://127.0.0.1:{port}/0", timeout_s=0.5)
    with pytest.raises(OSError):
        await client.execute("PING")
    await client.close()


async def test_a_connect_while_this_loop_stood_still_is_not_a_timeout(redis_url: str) -> None:
    """The loop stands still past the timeout while the connect is under way (a full garbage
    collection of a large heap: CI saw "Redis did not accept a connection in time" from a healthy
    Redis). The stall is this process's, not Redis's: the connect completes and the command runs."""
    client = RespClient(redis_url, timeout_s=0.3)
    asyncio.get_running_loop().call_soon(time.sleep, 0.5)
    assert await client.execute("PING") == b"PONG"
    await client.close()
