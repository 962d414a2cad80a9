"""The probe loop survives a gateway address that answers with something else than the admin API
(an ingress's maintenance page, a proxy's error body with a success status): each setup call is a
``ProbeSetupError`` naming the step, so the round is reported as not run and the schedule goes
on. Such an answer raised ValueError or KeyError out of the probe loop, which ended the process
with a traceback and left the heartbeat to go stale. The ingress here is a stand-in on a real
socket (outside the project: any HTTP front), answering every route with a success status."""

from __future__ import annotations

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from canary.cli import EXIT_SETUP, _probe_once
from canary.findings import ProbeKind
from canary.markers import MarkerCodec, MarkerKeyring
from canary.probe_client import GatewayClient, ProbeSetupError, ProbeTenant
from canary.probes import ProbeRunner
from kvguard.testing import serve

PAGE = "<html><body>Down for maintenance</body></html>"


def _ingress() -> Starlette:
    async def tenant(request: Request) -> Response:
        return JSONResponse({"error": "not found"}, status_code=404)

    async def created(request: Request) -> Response:
        return HTMLResponse(PAGE, status_code=201)

    async def models(request: Request) -> Response:
        return JSONResponse({"data": [{"name": "no id"}]})

    async def engines(request: Request) -> Response:
        return JSONResponse({"engines": "elsewhere"})

    return Starlette(
        routes=[
            Route("/admin/tenants/{name}", tenant),
            Route("/admin/tenants", created, methods=["POST"]),
            Route("/v1/models", models),
            Route("/admin/engines", engines),
        ]
    )


async def test_answers_that_are_not_the_admin_apis_are_setup_errors_and_the_loop_goes_on() -> None:
    server = await serve(_ingress())
    try:
        async with httpx.AsyncClient(base_url=server.url) as http:
            gateway = GatewayClient(http, admin_token="t" * 32)
            with pytest.raises(ProbeSetupError, match="create probe tenant"):
                await gateway.ensure_tenant("probe-a")
            tenant = ProbeTenant(id="tn_x", name="probe-a", key="kvg_x_y")
            with pytest.raises(ProbeSetupError, match="list models"):
                await gateway.first_model(tenant)
            with pytest.raises(ProbeSetupError, match="list engines"):
                await gateway.engine_limits("m")
            codec = MarkerCodec(MarkerKeyring({1: b"k" * 32}, current=1))
            runner = ProbeRunner(gateway, codec, tenant_prefix="probe", model=None)
            assert await _probe_once(runner, list(ProbeKind), report=False) == EXIT_SETUP
    finally:
        await server.stop()
