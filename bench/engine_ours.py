"""kvguard's side of ``bench_engine``: the in-process ``AsyncEngine`` and the HTTP server.

- ``serve_engine``: ``concurrency`` closed-loop clients (see ``engine_common``) submit to one
  running ``AsyncEngine`` and read its ``Generation`` events, in this process.
- ``serve_http``: the same clients through the real FastAPI app (``create_app``) served by
  uvicorn on 127.0.0.1 in this process, streaming ``/v1/completions`` with httpx. The client
  shares the process (and its 2 cores) with the server, so this is an upper bound on the HTTP
  overhead a remote client would see.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable

import httpx
import uvicorn

from backend.config import BackendSettings
from backend.core.request import FinishReason, SamplingParams
from backend.engine.async_engine import AsyncEngine
from bench.engine_common import Trace, Workload

Client = Callable[[int, float], Awaitable[Trace]]


async def closed_loop(workload: Workload, concurrency: int, client: Client) -> list[Trace]:
    """Client ``j`` sends requests ``j, j + C, ...``, each when its previous one is complete."""
    start = time.perf_counter()
    traces: list[Trace | None] = [None] * len(workload)

    async def run(j: int) -> None:
        for i in range(j, len(workload), concurrency):
            traces[i] = await client(i, start)

    await asyncio.gather(*(run(j) for j in range(min(concurrency, len(workload)))))
    return [t for t in traces if t is not None]


async def serve_engine(
    engine: AsyncEngine, workload: Workload, concurrency: int, tag: str
) -> list[Trace]:
    async def client(i: int, start: float) -> Trace:
        trace = Trace(sent=time.perf_counter() - start)
        sampling = SamplingParams(max_tokens=workload.max_tokens[i], temperature=0.0)
        generation = engine.submit(
            request_id=f"{tag}-{i}",
            tenant=f"tenant-{i % 4}",
            prompt_ids=workload.prompt_ids(i),
            sampling=sampling,
        )
        async for event in generation.events():
            if event.token is not None:
                trace.record(time.perf_counter() - start, event.token)
            if event.is_terminal and event.finish_reason not in (
                FinishReason.LENGTH,
                FinishReason.STOP,
            ):
                raise RuntimeError(f"request {i} ended with {event.state}: {event.error}")
        return trace

    return await closed_loop(workload, concurrency, client)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def serve_http(
    settings: BackendSettings, workload: Workload, concurrency: int
) -> list[Trace]:
    """TTFT and per-token latency here are those of SSE chunks that carry text (tokens that end
    a UTF-8 character); the token count is the server's own usage report."""
    from backend.server.app import create_app

    port = _free_port()
    app = create_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    limits = httpx.Limits(max_connections=concurrency + 4)
    try:
        async with httpx.AsyncClient(timeout=None, limits=limits) as http:
            url = f"http://127.0.0.1:{port}/v1/completions"

            model = settings.served_model_name or settings.model.name

            async def client(i: int, start: float) -> Trace:
                return await _http_request(http, url, model, workload, i, start)

            await client(0, time.perf_counter())  # warm-up: first request through the stack
            return await closed_loop(workload, concurrency, client)
    finally:
        server.should_exit = True
        await serving


async def _http_request(
    http: httpx.AsyncClient, url: str, model: str, workload: Workload, i: int, start: float
) -> Trace:
    body = {
        "model": model,
        "prompt": workload.texts[i],
        "max_tokens": workload.max_tokens[i],
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    trace = Trace(sent=time.perf_counter() - start)
    chunks = 0
    headers = {"X-Kvguard-Tenant": f"tenant-{i % 4}"}
    async with http.stream("POST", url, json=body, headers=headers) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[len("data: ") :])
            if "error" in payload:
                raise RuntimeError(f"request {i} failed: {payload['error']}")
            if payload.get("usage"):
                trace.tokens = int(payload["usage"]["completion_tokens"])
            elif payload["choices"] and payload["choices"][0]["text"]:
                now = time.perf_counter() - start
                trace.first_token = trace.first_token if trace.first_token is not None else now
                trace.last_token = now
                chunks += 1
    if trace.first_token is None:
        raise RuntimeError(f"request {i} streamed no text")
    return trace
