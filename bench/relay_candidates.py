"""The data plane's server layer and upstream reader, chosen by measuring candidates side by side.

Run: ``python -m bench.relay_candidates [--quick] [--rounds N] [--out FILE]`` (``--help``); one
candidate alone: ``python -m bench.relay_candidates serve KIND --port P --upstream URL``.

Every candidate is a pass-through with no check at all (the cost of the layer itself: the
gateway's checks come on top of whichever is chosen), in front of the relay benchmark's engine
stand-in (``bench.relay_standin``), pinned to one core, under the same open-loop load
(``bench.relay_load``) as ``bench.bench_relay``, in rounds with the order rotated:

- ``aiohttp pass-through`` (``bench.relay_floors``): the reference of the issue-33 goals;
- ``asgi-uvicorn``: a raw ASGI app for the route under uvicorn (httptools), the upstream read
  through the gateway's own client (``gateway.upstream.wire``) one read per ``await``, each read
  sent as an ASGI message;
- ``granian-rsgi``: the same reads, served by granian's RSGI protocol (``send_bytes`` per read);
- ``protocol-aiohttp-iter``, ``protocol-aiohttp-readany``: the gateway's server protocol
  (``gateway.proxy.server.DataPlaneProtocol``: uvicorn's, with each chunk written straight to the
  socket), the upstream read with aiohttp (``content.iter_any()``, what the gateway used;
  ``content.readany()``, one generator fewer);
- ``protocol-wire-push``: the gateway's protocol, the engine connection's reads pushed straight to
  the client's socket (no task wakes per read): the design the gateway uses;
- ``pump-no-checks``: the gateway's own data plane with every check off -- its protocol, its
  client, ``StreamPump`` and ``StreamRelay`` (the body parsed, every event parsed and relayed
  through a pass-through guard, the token clock kept) and its replies, without the door (key,
  schema), admission, limits, the firewall, audit, metrics or spans. ``bench.bench_relay`` runs it
  beside the gateway: the floor of what its checks can cost less than.

Printed: CPU µs per streamed event (64-token answers, 67 events, at ``--stream-rate`` streams/s)
and per non-streaming request (at ``--cost-rate`` requests/s), median and min-max over rounds,
and each as a ratio to the aiohttp pass-through's of the same round.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import uvloop

from bench.relay_load import Driver, Workload, chat_request
from bench.relay_standin import MODEL
from bench.relay_systems import Relay, Systems, _on_relay_cpu, _wait_http, pin_self
from gateway.upstream.wire import Exchange, Origin, WirePool, request_head
from kvguard.localservices import free_port

TOKENS = 64
INTERVAL_S = 0.010
RESULTS = Path(__file__).resolve().parent / "results" / "relay-candidates.md"
KINDS = (
    "pump-no-checks",
    "asgi-uvicorn",
    "granian-rsgi",
    "protocol-aiohttp-iter",
    "protocol-aiohttp-readany",
    "protocol-wire-push",
)
Send = Callable[[dict[str, Any]], Awaitable[None]]
_SSE = [(b"content-type", b"text/event-stream")]
_JSON = [(b"content-type", b"application/json")]


# ---- the candidates ------------------------------------------------------------------------


class Upstream:
    """The stand-in through the gateway's client (``wire``) or aiohttp."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.origin = Origin.of(self.url)
        self.pool = WirePool(connect_timeout_s=5, read_timeout_s=60)
        self._aiohttp: Any = None

    async def wire(self, path: str, body: bytes) -> Exchange:
        head = request_head(self.origin, path, {}, len(body))
        return await self.pool.exchange(self.origin, head, body)

    async def aiohttp(self, path: str, body: bytes) -> Any:
        import aiohttp

        if self._aiohttp is None:
            self._aiohttp = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        headers = {"content-type": "application/json"}
        return await self._aiohttp.post(self.url + path, data=body, headers=headers)


def _streamed(content_type: bytes | str) -> bool:
    value = content_type.decode() if isinstance(content_type, bytes) else content_type
    return value.startswith("text/event-stream")


async def _read_body(receive: Callable[[], Awaitable[dict[str, Any]]]) -> bytes:
    parts, more = [], True
    while more:
        message = await receive()
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    return b"".join(parts)


def asgi_app(upstream: Upstream, kind: str) -> Callable[..., Awaitable[None]]:
    async def app(scope: dict[str, Any], receive: Any, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] == "GET":
            await send({"type": "http.response.start", "status": 200, "headers": _JSON})
            await send({"type": "http.response.body", "body": b"{}"})
            return
        body = await _read_body(receive)
        if kind == "pump-no-checks":
            await _pump_no_checks(upstream, scope, receive, send, body)
        elif kind == "asgi-uvicorn":
            await _asgi_wire(upstream, scope["path"], body, send)
        else:
            await _direct(upstream, kind, scope, body, send)

    return app


async def _asgi_wire(upstream: Upstream, path: str, body: bytes, send: Send) -> None:
    exchange = await upstream.wire(path, body)
    if not _streamed(exchange.content_type):
        data = await exchange.read_all()
        exchange.release()
        await send({"type": "http.response.start", "status": exchange.status, "headers": _JSON})
        await send({"type": "http.response.body", "body": data})
        return
    await send({"type": "http.response.start", "status": 200, "headers": _SSE})
    while chunk := await exchange.next_chunk():
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    exchange.release()
    await send({"type": "http.response.body", "body": b""})


class _PushToSocket:
    """A ``BodySink`` writing each pushed read to the client's socket as one HTTP chunk."""

    def __init__(self, transport: Any) -> None:
        self.transport = transport
        self.done = asyncio.get_running_loop().create_future()

    def data(self, chunk: bytes) -> None:
        self.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))

    def end(self) -> None:
        self.done.set_result(None)

    def lost(self, error: Exception) -> None:
        self.end()


async def _direct(
    upstream: Upstream, kind: str, scope: dict[str, Any], body: bytes, send: Send
) -> None:
    from gateway.proxy.reply import DIRECT

    handle = scope["extensions"][DIRECT]
    transport = handle.connection.transport
    if kind == "protocol-wire-push":
        exchange = await upstream.wire(scope["path"], body)
        if not _streamed(exchange.content_type):
            data = await exchange.read_all()
            exchange.release()
            await send({"type": "http.response.start", "status": 200, "headers": _JSON})
            await send({"type": "http.response.body", "body": data})
            return
        await send({"type": "http.response.start", "status": 200, "headers": _SSE})
        sink = _PushToSocket(transport)
        exchange.attach(sink)
        await sink.done
        exchange.release()
        await send({"type": "http.response.body", "body": b""})
        return
    answer = await upstream.aiohttp(scope["path"], body)
    if not _streamed(answer.headers.get("content-type", "")):
        data = await answer.read()
        answer.release()
        await send({"type": "http.response.start", "status": 200, "headers": _JSON})
        await send({"type": "http.response.body", "body": data})
        return
    await send({"type": "http.response.start", "status": 200, "headers": _SSE})
    if kind == "protocol-aiohttp-iter":
        async for chunk in answer.content.iter_any():
            transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
    else:
        while chunk := await answer.content.readany():
            transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
    answer.release()
    await send({"type": "http.response.body", "body": b""})


async def _pump_no_checks(
    upstream: Upstream, scope: dict[str, Any], receive: Any, send: Send, body: bytes
) -> None:
    from contracts.plugins import PassThroughGuard
    from gateway.metrics import LATENCY_BUCKETS
    from gateway.proxy.body import relay_body
    from gateway.proxy.relay import StreamRelay
    from gateway.proxy.reply import reply_for
    from gateway.proxy.stream import StreamPump, TokenClock
    from gateway.upstream.base import Endpoint

    reply = reply_for(scope, receive, send)
    request = orjson.loads(body)
    endpoint = Endpoint.CHAT if scope["path"] == Endpoint.CHAT.path else Endpoint.COMPLETIONS
    exchange = await upstream.wire(scope["path"], orjson.dumps(request))
    if not request.get("stream"):
        answer = orjson.loads(await exchange.read_all() or b"{}")
        exchange.release()
        await reply.json(200, relay_body(endpoint, answer, PassThroughGuard, screen_side=False), {})
        return
    options = request.get("stream_options") or {}
    relay = StreamRelay(
        endpoint=endpoint,
        open_guard=PassThroughGuard,
        wants_usage=bool(options.get("include_usage")),
        screen_side=False,
    )
    pump = StreamPump(relay, reply, TokenClock(LATENCY_BUCKETS))
    await reply.start_stream({})
    exchange.attach(pump)
    await pump.done
    exchange.release(linger=True)
    await reply.end_stream(pump.last)


class RsgiApp:
    """granian's RSGI interface: ``__rsgi__(scope, protocol)``; the upstream from the environment
    (granian imports the app by name in its worker)."""

    def __init__(self) -> None:
        self.upstream: Upstream | None = None

    async def __rsgi__(self, scope: Any, protocol: Any) -> None:
        if self.upstream is None:
            self.upstream = Upstream(os.environ["RELAY_CANDIDATE_UPSTREAM"])
        if scope.method == "GET":
            protocol.response_bytes(200, [("content-type", "application/json")], b"{}")
            return
        body = await protocol()
        exchange = await self.upstream.wire(scope.path, body)
        if not _streamed(exchange.content_type):
            data = await exchange.read_all()
            exchange.release()
            protocol.response_bytes(200, [("content-type", "application/json")], data)
            return
        transport = protocol.response_stream(200, [("content-type", "text/event-stream")])
        while chunk := await exchange.next_chunk():
            await transport.send_bytes(chunk)
        exchange.release()


rsgi_app = RsgiApp()


def serve(kind: str, port: int, upstream_url: str) -> None:
    if kind == "granian-rsgi":
        from granian import Granian

        os.environ["RELAY_CANDIDATE_UPSTREAM"] = upstream_url
        Granian(
            "bench.relay_candidates:rsgi_app",
            address="127.0.0.1",
            port=port,
            interface="rsgi",
            workers=1,
            loop="uvloop",
            log_enabled=False,
        ).serve()
        return
    import uvicorn

    from contracts.http_edge import EdgeServer
    from gateway.proxy.server import data_plane_protocol

    app = asgi_app(Upstream(upstream_url), kind)
    http: Any = "httptools" if kind == "asgi-uvicorn" else data_plane_protocol(header_timeout_s=15)
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="off",
        http=http,
        loop="uvloop",
    )
    EdgeServer(config).run()


# ---- the measurement -----------------------------------------------------------------------


def start(systems: Systems, kind: str, upstream: str) -> Relay:
    port = free_port()
    argv = [sys.executable, "-m", "bench.relay_candidates", "serve", kind, "--port", str(port)]
    proc, log = systems._spawn(f"candidate-{kind}", _on_relay_cpu([*argv, "--upstream", upstream]))
    _wait_http(f"http://127.0.0.1:{port}/", proc, log)
    return Relay(kind, port, MODEL, proc.pid)


async def measure(args: argparse.Namespace, systems: Systems) -> dict[str, dict[str, list]]:
    upstream = systems.standin(engines=1, interval_s=INTERVAL_S)
    relays = [systems.floor("aiohttp", upstream)]
    relays += [start(systems, kind, upstream) for kind in args.kinds]
    drivers = {r.name: Driver("127.0.0.1", r.port) for r in relays}

    def workload(relay: Relay, stream: bool) -> Workload:
        host = f"127.0.0.1:{relay.port}"
        request = chat_request(
            host, model=MODEL, key=None, content="Relay this.", tokens=TOKENS, stream=stream
        )
        return Workload((request,), stream, TOKENS, INTERVAL_S)

    async def run(relay: Relay, stream: bool, rate: float, seconds: float) -> float:
        got = await drivers[relay.name].run(
            workload(relay, stream), rate=rate, seconds=seconds, cpu_pids=[relay.pid or 0],
            load_pids=[systems.standin_pid],
        )  # fmt: skip
        units = got.ok * (TOKENS + 3) if stream else got.ok
        per = (got.cpu_s or 0.0) / units * 1e6 if units else float("nan")
        print(f"  {relay.name:26} {'stream' if stream else 'plain':6} ok {got.ok:5} "
              f"err {got.errors:3} {per:8.1f} µs", file=sys.stderr, flush=True)  # fmt: skip
        return per

    for relay in relays:  # warm code paths and connection pools
        await run(relay, True, 10, 1)
        await run(relay, False, 50, 1)
    found: dict[str, dict[str, list]] = {r.name: {"event": [], "request": []} for r in relays}
    for r in range(args.rounds):
        shift = r % len(relays)
        for relay in relays[shift:] + relays[:shift]:
            found[relay.name]["event"].append(
                await run(relay, True, args.stream_rate, args.seconds)
            )
            found[relay.name]["request"].append(
                await run(relay, False, args.cost_rate, args.seconds)
            )
    return found


def table(found: dict[str, dict[str, list]], command: str) -> str:
    base = found["aiohttp pass-through"]

    def cell(values: list[float], ref: list[float], digits: int) -> str:
        ratios = sorted(v / b for v, b in zip(values, ref, strict=True))
        mid = sorted(values)[len(values) // 2]
        return (
            f"{mid:,.{digits}f} ({min(values):,.{digits}f}-{max(values):,.{digits}f}) | "
            f"{ratios[len(ratios) // 2]:.2f}x"
        )

    rows = [
        "### Server layer and upstream reader: pass-through candidates (no checks)",
        "",
        f"- Command: `{command}`",
        "- Each candidate pinned to CPU 0; load generator and stand-in on CPU 1; 64-token "
        "streamed answers (67 SSE events, one every 10 ms); median (min-max) over rounds; "
        "ratio: to the aiohttp pass-through of the same round (median of the rounds' ratios)",
        "",
        "| candidate | CPU µs / streamed event | vs aiohttp | CPU µs / request | vs aiohttp |",
        "|---|---|---|---|---|",
    ]
    for name, values in found.items():
        rows.append(
            f"| {name} | {cell(values['event'], base['event'], 1)} | "
            f"{cell(values['request'], base['request'], 0)} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:
        parser = argparse.ArgumentParser(prog="relay_candidates serve")
        parser.add_argument("kind", choices=KINDS)
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--upstream", required=True)
        args = parser.parse_args(argv[1:])
        serve(args.kind, args.port, args.upstream)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 3 s")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--stream-rate", type=float, default=10.0, help="streams/s")
    parser.add_argument("--cost-rate", type=float, default=100.0, help="requests/s")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--out", type=Path, default=RESULTS, help="the table of record")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.seconds = 2, 3.0
    pin_self()
    with tempfile.TemporaryDirectory(prefix="kvguard-relay-candidates-") as tmp:
        systems = Systems(Path(tmp))
        try:
            found = uvloop.run(measure(args, systems))
        finally:
            systems.close()
    text = table(found, "python -m bench.relay_candidates " + " ".join(argv))
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    if args.out.resolve() == RESULTS:  # the table of record: the benchmark page shows it
        from bench import relay_report

        relay_report.refresh_page()
    return 0


if __name__ == "__main__":
    sys.exit(main())
