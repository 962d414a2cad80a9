"""The floors of the relay benchmark: what moving a request's bytes costs with no check at all.

``python -m bench.relay_floors aiohttp|lean --port P --upstream http://127.0.0.1:Q``

- ``aiohttp``: the naive pass-through most Python gateways are built like -- an ``aiohttp.web``
  handler that reads the request, posts it upstream with one shared ``ClientSession`` and relays
  the answer (``StreamResponse.write`` per chunk ``iter_any`` hands it), on uvloop. No auth, no
  limits, no parsing of what passes.
- ``lean``: the leanest relay this benchmark's author could write in Python: raw asyncio
  protocols on uvloop, httptools parsing, one pool of kept-alive upstream connections. The
  request head is rewritten (the client's headers are not forwarded), the body passes as bytes;
  the answer's bytes (head and chunked framing included) go to the client in one write per
  upstream read, i.e. everything the kernel has buffered by then is coalesced into one write;
  the upstream response parser only finds where the answer ends. Flow control: a client that
  reads slowly pauses the upstream connection.

Neither checks, screens, counts or records anything: they are the cost of moving bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from urllib.parse import urlsplit

import httptools
import uvloop

from bench.relay_http import HttpConnection, RequestReader

# ---- the naive floor: aiohttp ------------------------------------------------------------------


def run_aiohttp(port: int, upstream: str) -> None:
    from aiohttp import ClientSession, TCPConnector, web

    session: ClientSession | None = None

    async def relay(request: web.Request) -> web.StreamResponse:
        assert session is not None
        body = await request.read()
        headers = {"Content-Type": "application/json"}
        async with session.post(upstream + request.path, data=body, headers=headers) as answer:
            if answer.headers.get("Content-Type", "").startswith("text/event-stream"):
                response = web.StreamResponse(
                    status=answer.status, headers={"Content-Type": "text/event-stream"}
                )
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response
            data = await answer.read()
            return web.Response(body=data, status=answer.status, content_type="application/json")

    async def open_session(app: web.Application) -> None:
        nonlocal session
        session = ClientSession(connector=TCPConnector(limit=0))

    async def close_session(app: web.Application) -> None:
        if session is not None:
            await session.close()

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/{tail:.*}", relay)
    app.on_startup.append(open_session)
    app.on_cleanup.append(close_session)
    web.run_app(
        app, host="127.0.0.1", port=port, access_log=None, print=None, loop=uvloop.new_event_loop()
    )


# ---- the lean floor: raw protocols -------------------------------------------------------------


class Upstream(HttpConnection):
    """One kept-alive connection to the engine; relays one answer at a time to ``client``."""

    def __init__(self, pool: Pool) -> None:
        super().__init__(httptools.HttpResponseParser)
        self.pool = pool
        self.client: Client | None = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.ready.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        client, self.client = self.client, None
        if client is not None:
            client.upstream_lost()

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is not None:
            client.write(data)
        super().data_received(data)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            client.answer_done()
        if self.transport is not None and self.parser.should_keep_alive():
            self.pool.idle.append(self)
        elif self.transport is not None:
            self.transport.close()


class Pool:
    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.idle: list[Upstream] = []

    async def take(self) -> Upstream:
        while self.idle:
            conn = self.idle.pop()
            if conn.transport is not None and not conn.transport.is_closing():
                return conn
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: Upstream(self), self.host, self.port)
        await conn.ready
        return conn


class Client(RequestReader):
    """One client connection: parse a request, forward it, pass the answer's bytes back."""

    def __init__(self, pool: Pool, host_header: bytes) -> None:
        super().__init__()
        self.pool = pool
        self.host_header = host_header
        self.upstream: Upstream | None = None

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        upstream, self.upstream = self.upstream, None
        if upstream is not None and upstream.transport is not None:
            upstream.client = None
            upstream.transport.close()  # mid-answer: the engine sees the client go away

    def request(self, url: bytes, body: bytes) -> None:
        head = (
            b"POST %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n" % (url, self.host_header, len(body))
        )
        asyncio.get_running_loop().create_task(self.forward(head + body))

    async def forward(self, request: bytes) -> None:
        upstream = await self.pool.take()
        if self.transport is None or upstream.transport is None:
            return
        self.upstream = upstream
        upstream.client = self
        upstream.transport.write(request)

    def write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)

    def answer_done(self) -> None:
        self.upstream = None

    def upstream_lost(self) -> None:
        self.upstream = None
        if self.transport is not None:
            self.transport.close()

    def pause_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.upstream is not None and self.upstream.transport is not None:
            self.upstream.transport.resume_reading()


async def serve_lean(port: int, upstream: str) -> None:
    parts = urlsplit(upstream)
    assert parts.hostname is not None and parts.port is not None
    pool = Pool(parts.hostname, parts.port)
    host_header = parts.netloc.encode()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: Client(pool, host_header), "127.0.0.1", port, backlog=4096
    )
    await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=("aiohttp", "lean"))
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="the engine's base URL")
    args = parser.parse_args(argv)
    if args.kind == "aiohttp":
        run_aiohttp(args.port, args.upstream.rstrip("/"))
    else:
        uvloop.run(serve_lean(args.port, args.upstream.rstrip("/")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
