"""A server whose engine loop failed says so: ``/health`` answers 503 (a supervisor restarts the
process), ``/engine/capacity`` names the failure as ``unavailable`` (the gateway stops routing
here), and a chat gets a clear 503 ``engine_failed`` instead of waiting for its timeout."""

from __future__ import annotations

import asyncio

import httpx

from backend.config import BackendSettings
from backend.server.app import create_app
from tests.backend.engine.test_engine_async import _FailingOnce


async def test_a_failed_engine_is_unhealthy_unavailable_and_refuses_chats(
    tiny_checkpoint: str,
) -> None:
    app = create_app(BackendSettings(model=tiny_checkpoint, pool_tokens=512, page_size=16))
    async with app.router.lifespan_context(app):
        engine = app.state.service.engine
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
            assert (await client.get("/health")).status_code == 200
            engine.core.scheduler = _FailingOnce(engine.core.scheduler)
            model = app.state.service.model_name
            chat = {"model": model, "messages": [{"role": "user", "content": "Repeat exactly: hi"}]}
            first = await asyncio.wait_for(client.post("/v1/chat/completions", json=chat), 30)
            assert first.status_code == 503, first.text
            assert first.json()["error"]["code"] == "engine_failed"
            health = await client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "failed"
            capacity = (await client.get("/engine/capacity")).json()
            assert "engine failed" in capacity["unavailable"]
            assert capacity["max_request_tokens"] == 0
            again = await client.post("/v1/chat/completions", json=chat)
            assert again.status_code == 503 and again.json()["error"]["code"] == "engine_failed"
