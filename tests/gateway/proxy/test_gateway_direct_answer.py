"""A whole answer written below ASGI (``gateway.proxy.reply.DirectReply.json``) keeps what uvicorn's
``send`` did for it: the request-id headers on every answer, the server's default headers, HTTP
keep-alive and pipelining (the next request on the connection is served after the answer), a
HEAD answered without a body, ``connection: close`` honoured. Read off a raw socket with h11, so
the bytes are the ones the gateway wrote. And the flight's ``Watch``: one cancellation, held off
while a part that must finish runs, told apart from the server's."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

import h11
import pytest
from gateway_harness import running_gateway
from gateway_standin import StandInEngine

from gateway.config import GatewaySettings
from gateway.proxy.reply import Watch

MODEL = "standin-model"


def _post(path: str, key: str, body: dict[str, object], *, close: bool = False) -> bytes:
    payload = json.dumps(body)
    return (
        f"POST {path} HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
        + ("Connection: close\r\n" if close else "")
        + f"\r\n{payload}"
    ).encode()


async def _answers(
    reader: asyncio.StreamReader, count: int, *, head_only: tuple[int, ...] = ()
) -> list[tuple[h11.Response, bytes]]:
    """``count`` answers off one connection, in order (the ones at ``head_only``: to a HEAD)."""
    client = h11.Connection(h11.CLIENT)
    found: list[tuple[h11.Response, bytes]] = []
    for i in range(count):
        method = b"HEAD" if i in head_only else b"POST"
        client.send(h11.Request(method=method, target="/", headers=[("host", "gateway")]))
        client.send(h11.EndOfMessage())
        response: h11.Response | None = None
        body = b""
        while True:
            event = client.next_event()
            if event is h11.NEED_DATA:
                data = await asyncio.wait_for(reader.read(65536), 30)
                client.receive_data(data)
                continue
            if isinstance(event, h11.Response):
                response = event
            elif isinstance(event, h11.Data):
                body += bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                break
        assert response is not None
        found.append((response, body))
        if client.our_state is h11.MUST_CLOSE or client.their_state is h11.MUST_CLOSE:
            break
        client.start_next_cycle()
    return found


def _headers(response: h11.Response) -> dict[bytes, list[bytes]]:
    out: dict[bytes, list[bytes]] = {}
    for name, value in response.headers:
        out.setdefault(bytes(name), []).append(bytes(value))
    return out


def _settings(
    make_settings: Callable[..., GatewaySettings], standin: StandInEngine
) -> GatewaySettings:
    return make_settings(engines=[{"name": "standin", "kind": "bundled", "base_url": standin.url}])


@contextlib.asynccontextmanager
async def _connected(
    make_settings: Callable[..., GatewaySettings], standin: StandInEngine
) -> AsyncIterator[tuple[str, asyncio.StreamReader, asyncio.StreamWriter]]:
    """A served gateway with a tenant: its key, and a raw connection to the gateway."""
    async with running_gateway(_settings(make_settings, standin)) as gw:
        _, key = await gw.create_tenant("acme")
        url = gw.client.base_url
        reader, writer = await asyncio.open_connection(url.host, url.port)
        try:
            yield key, reader, writer
        finally:
            writer.close()


async def test_pipelined_answers_keep_their_order_ids_and_the_connection(
    make_settings: Callable[..., GatewaySettings], standin: StandInEngine
) -> None:
    async with _connected(make_settings, standin) as (key, reader, writer):
        ok = {"model": MODEL, "prompt": "alpha beta", "max_tokens": 2}
        # three requests in one write: an answer, a refusal, an answer
        writer.write(
            _post("/v1/completions", key, ok)
            + _post("/v1/completions", "sk-wrong", ok)
            + _post("/v1/completions", key, {**ok, "prompt": "gamma"})
        )
        await writer.drain()
        answers = await _answers(reader, 3)
        # the connection is still kept: a fourth request on it is served
        writer.write(_post("/v1/completions", key, ok, close=True))
        await writer.drain()
        last = await _answers(reader, 1)
        assert await reader.read() == b""  # closed after the answer that asked for it
    statuses = [response.status_code for response, _ in answers + last]
    assert statuses == [200, 401, 200, 200]
    ids = set()
    for response, body in answers + last:
        headers = _headers(response)
        # the server's default headers, the request ids (one of each), the body's length
        assert headers[b"server"] == [b"uvicorn"] and len(headers[b"date"]) == 1
        assert headers[b"x-kvguard-request-id"] == headers[b"x-request-id"]
        assert len(headers[b"x-request-id"]) == 1
        ids.add(headers[b"x-request-id"][0])
        assert headers[b"content-length"] == [str(len(body)).encode()]
        assert headers[b"content-type"] == [b"application/json"]
        assert "error" in json.loads(body) or json.loads(body)["object"] == "text_completion"
    assert len(ids) == 4  # an id per request
    assert _headers(answers[0][0]).get(b"connection") is None  # kept
    assert _headers(last[0][0])[b"connection"] == [b"close"]
    assert json.loads(answers[1][1])["error"]["code"] == "invalid_api_key"


async def test_pipelined_streams_keep_their_ids_their_chunks_and_the_connection(
    make_settings: Callable[..., GatewaySettings], standin: StandInEngine
) -> None:
    """A stream's head and end are written below ASGI too: the same headers as a whole answer's,
    HTTP chunks that end, the next pipelined request served after the stream ends."""
    async with _connected(make_settings, standin) as (key, reader, writer):
        stream = {"model": MODEL, "prompt": "alpha beta", "max_tokens": 3, "stream": True}
        writer.write(
            _post("/v1/completions", key, stream)
            + _post("/v1/completions", key, {**stream, "stream": False})
            + _post("/v1/completions", key, stream, close=True)
        )
        await writer.drain()
        answers = await _answers(reader, 3)
        assert await reader.read() == b""  # closed after the stream that asked for it
    assert [response.status_code for response, _ in answers] == [200, 200, 200]
    ids = set()
    for (response, body), streamed in zip(answers, (True, False, True), strict=True):
        headers = _headers(response)
        assert headers[b"server"] == [b"uvicorn"] and len(headers[b"date"]) == 1
        assert headers[b"x-kvguard-request-id"] == headers[b"x-request-id"]
        ids.add(headers[b"x-request-id"][0])
        if streamed:  # chunked (h11 read the chunks to their end), SSE to its [DONE]
            assert headers[b"transfer-encoding"] == [b"chunked"]
            assert headers[b"content-type"] == [b"text/event-stream; charset=utf-8"]
            assert b"content-length" not in headers
            events = [e for e in body.decode().split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            texts = [json.loads(e.removeprefix("data: "))["choices"] for e in events[:-1]]
            assert "".join(c[0]["text"] for c in texts if c) != ""
        else:
            assert json.loads(body)["object"] == "text_completion"
    assert len(ids) == 3
    assert _headers(answers[0][0]).get(b"connection") is None  # kept
    assert _headers(answers[2][0])[b"connection"] == [b"close"]


async def test_a_head_is_answered_without_a_body_and_the_next_request_follows(
    make_settings: Callable[..., GatewaySettings], standin: StandInEngine
) -> None:
    async with _connected(make_settings, standin) as (key, reader, writer):
        head = b"HEAD /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\n\r\n"
        ok = {"model": MODEL, "prompt": "alpha", "max_tokens": 1}
        writer.write(head + _post("/v1/completions", key, ok))
        await writer.drain()
        (refused, nothing), (answer, body) = await _answers(reader, 2, head_only=(0,))
    assert refused.status_code == 405 and nothing == b""
    assert _headers(refused)[b"allow"] == [b"POST"]
    assert int(_headers(refused)[b"content-length"][0]) > 0  # the length a GET would have had
    assert answer.status_code == 200 and json.loads(body)["object"] == "text_completion"


# -- the flight's watch ------------------------------------------------------------------------


async def test_a_watch_cancels_once_and_tells_its_cancellation_from_the_servers() -> None:
    started = asyncio.Event()

    async def flight(watch_of: list[Watch]) -> str:
        task = asyncio.current_task()
        assert task is not None
        watch = Watch(task)
        watch_of.append(watch)
        try:
            started.set()
            await asyncio.Event().wait()  # an engine that never answers
        except asyncio.CancelledError:
            if watch.claims():
                await asyncio.sleep(0)  # a cleanup awaits as usual: delivered once
                return "client gone"
            raise
        return "answered"

    watches: list[Watch] = []
    task = asyncio.create_task(flight(watches))
    await started.wait()
    watches[0].cancel()
    watches[0].cancel()  # a second call is nothing
    assert await task == "client gone"

    started.clear()
    watches.clear()
    task = asyncio.create_task(flight(watches))
    await started.wait()
    task.cancel()  # the server's: not the watch's, so it propagates
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not watches[0].fired


async def test_a_watch_holds_off_until_the_held_part_ends() -> None:
    """Cancelled while a held part (reporting a cut, closing the engine's stream) awaits, the
    part finishes first; the cancellation arrives at its end."""
    in_held = asyncio.Event()
    release = asyncio.Event()
    done: list[str] = []

    async def flight(watch_of: list[Watch]) -> None:
        task = asyncio.current_task()
        assert task is not None
        watch = Watch(task)
        watch_of.append(watch)
        with watch.held():
            in_held.set()
            await release.wait()
            done.append("held part finished")
        await asyncio.Event().wait()  # the rest of the flight
        done.append("not reached")

    watches: list[Watch] = []
    task = asyncio.create_task(flight(watches))
    await in_held.wait()
    watches[0].cancel()  # the client goes away while the held part awaits
    assert not watches[0].fired
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert watches[0].fired
    assert done == ["held part finished"]
