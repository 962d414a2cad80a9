"""Helpers to run gateway apps in tests: the app served over real HTTP on 127.0.0.1 by uvicorn
with the gateway's own protocol (so the completion routes run below ASGI, as in production), a
client, tenant creation."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from contracts.plugins import GatewayHooks
from contracts.settings import DEV_ADMIN_TOKEN
from gateway.app import create_app
from gateway.config import GatewaySettings
from gateway.state import GatewayState
from kvguard.testing import serve


@dataclass
class Gateway:
    app: Any
    state: GatewayState
    client: httpx.AsyncClient

    @property
    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.state.settings.admin_secret()}"}

    async def create_tenant(self, name: str, **limits: Any) -> tuple[str, str]:
        """(tenant id, first key) through the admin API."""
        response = await self.client.post(
            "/admin/tenants", json={"name": name, **limits}, headers=self.admin
        )
        assert response.status_code == 201, response.text
        body = response.json()
        return body["tenant"]["id"], body["key"]["key"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def until(
    check: Callable[[], Awaitable[bool] | bool], what: str, deadline_s: float = 10.0
) -> None:
    """Poll ``check`` until it holds, failing after ``deadline_s``."""
    deadline = time.monotonic() + deadline_s
    while True:
        result = check()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"not within {deadline_s:g} s: {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running_gateway(
    settings: GatewaySettings, *, hooks: GatewayHooks | None = None, span_exporter: Any = None
) -> AsyncIterator[Gateway]:
    app = create_app(settings, hooks=hooks, span_exporter=span_exporter)
    server = await serve(app, lifespan="on")
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            yield Gateway(app=app, state=app.state.gateway, client=client)
    finally:
        await server.stop()


__all__ = ["DEV_ADMIN_TOKEN", "Gateway", "bearer", "running_gateway", "until"]
