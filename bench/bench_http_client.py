"""The gateway's upstream HTTP client: CPU per request, httpx against aiohttp, side by side.

Run: ``python -m bench.bench_http_client [--requests N]``. It starts a minimal ASGI server (a
fixed completion body, so the server's cost is out of the picture: it runs in its own process)
and sends the same small JSON POST ``--requests`` times, one after another, with each client on
each event loop (asyncio, uvloop), in alternating rounds. What is measured is this process's
CPU time (``time.process_time``) per request: the cost the gateway's direct upstream path pays
per call. The direct path uses aiohttp because of this table; httpx stays for the capacity
poller and token counting, which are not per request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
import httpx
import uvloop

from bench.summary import emit
from kvguard.localservices import free_port
from kvguard.testing import wait_for

BODY = {"model": "m", "prompt": "hello", "max_tokens": 1, "temperature": 0}
SERVER = """
import sys, uvicorn
ANSWER = (b'{"id":"c1","object":"text_completion","choices":[{"index":0,"text":"a",'
          b'"finish_reason":"length"}],"usage":{"prompt_tokens":5,"completion_tokens":1}}')
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(ANSWER))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": ANSWER})
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""

Client = Callable[[str, int], Coroutine[Any, Any, float]]


async def with_httpx(url: str, n: int) -> float:
    async with httpx.AsyncClient() as client:
        for _ in range(50):
            (await client.post(url, json=BODY)).json()
        started = time.process_time()
        for _ in range(n):
            (await client.post(url, json=BODY)).json()
        return (time.process_time() - started) / n


async def with_aiohttp(url: str, n: int) -> float:
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:

        async def one() -> None:
            data = json.dumps(BODY, separators=(",", ":")).encode()
            async with session.post(url, data=data, headers=headers) as response:
                json.loads(await response.read())

        for _ in range(50):
            await one()
        started = time.process_time()
        for _ in range(n):
            await one()
        return (time.process_time() - started) / n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        wait_for(lambda: _answers(url), timeout_s=30, what="the fixed-answer server")
        clients: dict[str, Client] = {"httpx": with_httpx, "aiohttp": with_aiohttp}
        runners: dict[str, Callable[[Coroutine[Any, Any, float]], float]] = {
            "asyncio": asyncio.run,
            "uvloop": uvloop.run,
        }
        best: dict[tuple[str, str], float] = {}
        for _ in range(args.rounds):  # alternate; keep each cell's least disturbed round
            for loop_name, run in runners.items():
                for name, client in clients.items():
                    took = run(client(url, args.requests))
                    key = (loop_name, name)
                    best[key] = min(best.get(key, float("inf")), took)
    finally:
        server.terminate()
        server.wait(timeout=10)
    print("| event loop | httpx CPU ms/request | aiohttp CPU ms/request | httpx / aiohttp |")
    print("|---|---|---|---|")
    for loop_name in runners:
        h, a = best[(loop_name, "httpx")], best[(loop_name, "aiohttp")]
        print(f"| {loop_name} | {h * 1e3:.3f} | {a * 1e3:.3f} | {h / a:.1f}x |")
    ratio = best[("uvloop", "httpx")] / best[("uvloop", "aiohttp")]
    measure = "upstream client CPU per request, httpx / aiohttp (uvloop)"
    emit("http_client", measure, f"{ratio:.1f}x")
    return 0


def _answers(url: str) -> bool:
    try:
        return httpx.post(url, json=BODY, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())
