"""An engine that becomes unavailable while the gateway counts a prompt (found under load: decode
lost prefill during a request's admission) gets the client a 503, not a 400 "too long".

The stack's real decode + prefill serve the request (``stack``, shared with the load tests in
``conftest.py``); the poller's update is applied at the moment it raced
in the load test, between routing and fitting, through the request-hook seam: the hook records
what the poller records when decode reports ``unavailable`` (a limit of 0).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx

from bench.fault_stack import FaultStack
from contracts.plugins import GatewayHooks, RequestInfo
from gateway.app import create_app
from gateway.config import GatewaySettings

ENGINE = "real"


class BecomesUnavailable:
    """While armed, the engine reports its path unavailable as the request is being admitted."""

    def __init__(self) -> None:
        self.armed = False
        self.app: Any = None

    async def prepare(self, info: RequestInfo, body: dict[str, Any]) -> dict[str, Any]:
        if self.armed:
            registry = self.app.state.gateway.registry
            record = registry.get(ENGINE)
            gone = "the prefill role is unavailable: capacity not readable (ConnectError)"
            snapshot = dataclasses.replace(
                record.snapshot, unavailable=gone, reported_max_request_tokens=0
            )
            registry.record_success(ENGINE, snapshot)
        return body


async def test_engine_unavailable_during_counting_is_a_503_not_a_400(
    stack: FaultStack, sqlite_url: str
) -> None:
    settings = GatewaySettings(
        database_url=sqlite_url,
        poll_interval_s=30.0,
        capacity_stale_after_s=60.0,
        engines=[{"name": ENGINE, "kind": "bundled", "base_url": stack.decode.url}],
        engine_token=stack.engine_token,  # the stack's engines take calls only with it
    )
    hook = BecomesUnavailable()
    app = create_app(settings, hooks=GatewayHooks(request_hooks=[hook]))
    hook.app = app
    admin = {"Authorization": f"Bearer {settings.admin_secret()}"}
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            created = await client.post("/admin/tenants", json={"name": "t"}, headers=admin)
            key = created.json()["key"]["key"]
            model = (await client.get("/admin/engines", headers=admin)).json()[0]["model"]
            body = {"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0}
            headers = {"Authorization": f"Bearer {key}"}
            ok = await client.post("/v1/completions", json=body, headers=headers)
            assert ok.status_code == 200, ok.text

            hook.armed = True
            raced = await client.post("/v1/completions", json=body, headers=headers)
            assert raced.status_code == 503, raced.text
            assert raced.json()["error"]["code"] == "no_healthy_engine"
