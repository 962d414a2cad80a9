"""The gateway's client of the engines (capacity polls, token counts) never reuses a connection
that was idle for as long as half an engine's keep-alive.

vLLM, SGLang and the bundled engine serve with uvicorn, which closes a connection idle for 5 s;
the capacity poll comes every 5 s. With httpx's default expiry (also 5 s) the gateway kept each
poll's connection for the next one, which went out within milliseconds of the engine's close:
where the two cross, the poll reads a reset and the engine is blocked until the next poll (a
token count fails the same way). Here the stand-in engine is served by uvicorn with its default
keep-alive, as the real ones are, and each request's client port shows its connection.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from contracts.http_edge import CLIENT_KEEP_ALIVE_S
from gateway.app import engine_client
from gateway.config import GatewaySettings
from kvguard.testing import serve


def _engine(ports: list[int]) -> FastAPI:
    app = FastAPI()

    @app.get("/engine/capacity")
    async def capacity(request: Request) -> dict[str, str]:
        assert request.client is not None
        ports.append(request.client.port)
        return {}

    return app


async def test_a_connection_idle_for_half_an_engines_keep_alive_is_not_reused(
    make_settings: Any,
) -> None:
    settings: GatewaySettings = make_settings()
    ports: list[int] = []
    server = await serve(_engine(ports))
    client = engine_client(settings)
    try:
        # the stand-in's uvicorn keeps idle connections as long as the engines' do (5 s)
        assert server.server.config.timeout_keep_alive / 2 >= CLIENT_KEEP_ALIVE_S
        for _ in range(2):  # back to back: one kept-alive connection
            assert (await client.get(f"{server.url}/engine/capacity")).status_code == 200
        assert len(set(ports)) == 1
        await asyncio.sleep(CLIENT_KEEP_ALIVE_S + 0.2)  # the idle gap itself is what is tested
        assert (await client.get(f"{server.url}/engine/capacity")).status_code == 200
        assert len(set(ports)) == 2, "a connection idle past the client's expiry was reused"
    finally:
        await client.aclose()
        await server.stop()
