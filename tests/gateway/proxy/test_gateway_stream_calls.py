"""How many of the project's own calls one streamed event crosses (issue 33): the usual chunk,
from the engine connection's read to the client's write, with every check on (the leak
firewall in process on the text and the side fields), over a real socket to a served stream.

The profiler sees every Python call made under ``Connection.data_received`` (the event loop
calls it for the engine socket's read). Counted as the project's: functions in the project's
packages, and code that Python generates (a dataclass's ``__init__``: an object made per event).
The list is ``docs/architecture.md``'s; the tenth call is the client's write, the sink below
(``gateway.proxy.reply.DirectReply.write`` in the served gateway)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import FrameType
from typing import Any

from gateway.proxy.stream import StreamPump, TokenClock
from gateway.upstream.wire import Origin, WirePool
from tests.canary.firewall_in_process import new_relay

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = tuple(str(ROOT / name) + "/" for name in ("gateway", "canary", "contracts"))
BOUNDS = (0.001, 0.01, 0.1)
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nhost: e\r\ncontent-length: 0\r\n\r\n"
RESPONSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)

PATH = [
    "Connection.data_received",
    "Connection.on_body",
    "StreamPump.data",
    "StreamRelay.relay_event",
    "Frame.text_of",
    "FirewallGuard.passes",
    "StreamScanner.passes",
    "CandidateReader.quiet",
    "StreamPump._tick",
]


def _event(text: str) -> bytes:
    """One chat chunk as vLLM writes it (compact JSON on one line), in one HTTP chunk."""
    choice = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    chunk = {
        "id": "chatcmpl-7",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "Qwen/Qwen2.5-0.5B-Instruct",
        "choices": [choice],
    }
    data = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%b\r\n" % (len(data), data)


class _Client:
    """The client's side of the pump: what it was sent, and a wait for the next write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self._next: asyncio.Future[None] | None = None

    def write(self, data: bytes) -> None:
        self.writes.append(data)
        if self._next is not None and not self._next.done():
            self._next.set_result(None)

    def next_write(self) -> asyncio.Future[None]:
        self._next = asyncio.get_running_loop().create_future()
        return self._next


def _under_read(frame: FrameType | None) -> bool:
    while frame is not None:
        if frame.f_code.co_qualname == "Connection.data_received":
            return True
        frame = frame.f_back
    return False


async def test_a_usual_streamed_event_crosses_nine_calls_before_the_clients_write() -> None:
    connected: asyncio.Future[asyncio.StreamWriter] = asyncio.get_running_loop().create_future()

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(RESPONSE_HEAD)
        connected.set_result(writer)

    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = WirePool(connect_timeout_s=5.0, read_timeout_s=30.0)
    exchange = await pool.exchange(Origin("127.0.0.1", port, False), HEAD, b"")
    engine_writer = await connected
    client = _Client()
    pump = StreamPump(new_relay(), client, TokenClock(BOUNDS))
    exchange.attach(pump)
    try:
        for word in ("Hello", " there", ","):  # the first events open the guards
            written = client.next_write()
            engine_writer.write(_event(word))
            await asyncio.wait_for(written, 10)
        calls: list[str] = []

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            if event != "call" or not _under_read(frame):
                return
            file = frame.f_code.co_filename
            if file.startswith(PACKAGES) or file == "<string>":
                calls.append(frame.f_code.co_qualname)

        written = client.next_write()
        sys.setprofile(profile)
        try:
            engine_writer.write(_event(" friend"))
            await asyncio.wait_for(written, 10)
        finally:
            sys.setprofile(None)
        assert calls == PATH
        assert client.writes[-1] == _event(" friend").split(b"\r\n")[1]  # the engine's bytes
        assert len(client.writes) == 4 and pump.clock.gaps == 3
    finally:
        exchange.release()
        engine_writer.close()
        server.close()
        await server.wait_closed()
