"""``contracts.http_edge.EdgeServer``: uvicorn's server without its ten wake-ups a second. Its
main loop ticks once per ``tick_s`` (a second: the ``date`` header's refresh) and still exits at
once when told to: by ``should_exit`` set in its own loop or another thread (as tests and the
hostile harness stop a server), or by SIGTERM through uvicorn's signal handler (a real process)."""

from __future__ import annotations

import asyncio
import select
import signal
import subprocess
import sys
import textwrap
import threading
from typing import Any

import httpx
import uvicorn

from contracts.http_edge import EdgeServer


async def _hello(scope: Any, receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


class _Counted(EdgeServer):
    tick_s = 3600.0  # no tick comes on its own within a test: only an exit can wake the loop

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ticks = 0
        self.listening = asyncio.Event()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        self.listening.set()

    async def on_tick(self, counter: int) -> bool:
        self.ticks += 1
        return await super().on_tick(counter)


def _config() -> uvicorn.Config:
    return uvicorn.Config(_hello, host="127.0.0.1", port=0, log_level="warning", lifespan="off")


async def _started(server: _Counted) -> tuple[asyncio.Task[None], str]:
    task = asyncio.create_task(server.serve())
    listening = asyncio.create_task(server.listening.wait())
    await asyncio.wait({task, listening}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
    listening.cancel()
    assert server.started, "the server did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    return task, f"http://127.0.0.1:{port}"


async def test_the_loop_ticks_only_when_due_or_told_to_exit_and_the_date_is_set() -> None:
    server = _Counted(_config())
    task, url = await _started(server)
    async with httpx.AsyncClient() as client:
        for _ in range(3):
            answer = await client.get(url)
            assert answer.text == "hello"
            assert answer.headers["date"].endswith(" GMT")  # the tick at start set it
    assert server.ticks == 1  # the first tick only: served requests do not wake the loop
    server.should_exit = True
    await asyncio.wait_for(task, 30)  # not the hour a tick would take
    assert server.ticks == 2


async def test_should_exit_from_another_thread_wakes_the_loop() -> None:
    server = _Counted(_config())
    task, _ = await _started(server)
    setter = threading.Thread(target=setattr, args=(server, "should_exit", True))
    setter.start()
    await asyncio.wait_for(task, 30)
    setter.join()
    assert server.ticks == 2


def test_sigterm_stops_a_served_process_at_once() -> None:
    script = textwrap.dedent(
        """
        import sys, uvicorn
        from contracts.http_edge import EdgeServer

        async def app(scope, receive, send):
            await send({"type": "http.response.start", "status": 204, "headers": []})
            await send({"type": "http.response.body", "body": b""})

        class Server(EdgeServer):
            tick_s = 3600.0

            async def startup(self, sockets=None):
                await super().startup(sockets)
                print("started", flush=True)

            async def shutdown(self, sockets=None):
                print("shutting down", flush=True)
                await super().shutdown(sockets)

        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning")
        Server(config).run()
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 30)
        assert ready, "the server did not start"
        assert proc.stdout.readline().strip() == "started"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)  # an exit, not an hour's tick
        assert out.strip() == "shutting down", err  # uvicorn's graceful shutdown ran
        # then uvicorn raises the signal it caught again, as a process without it would end
        assert proc.returncode == -signal.SIGTERM, err
    finally:
        proc.kill()
        proc.wait()
