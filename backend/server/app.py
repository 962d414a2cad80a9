"""The engine's FastAPI application: built from settings in ``create_app``, started in the lifespan.

Start-up: build the role (model, real pool, limits, and for prefill/decode the transport and the
handoff) -> start the engine loop -> role start hook (decode: first read of prefill's capacity,
then keep it fresh) -> serve. Shutdown: role stop hook -> abort what is in flight (each client
gets a terminal event) -> join -> close the transport.

Routes per role: unified and decode serve the OpenAI API (decode is the entry point, with the same
contract); prefill serves the internal handoff endpoints. Every role serves /health, /metrics and
/engine/capacity; with fault drills allowed, decode also serves /engine/drill/*. Every route but
/health and /metrics takes the deployment's engine credential (``backend.server.auth``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from backend.config import BackendSettings
from backend.server import routes_drill, routes_handoff, routes_openai, routes_ops
from backend.server.auth import DecodePeers, EngineAuthMiddleware
from backend.server.errors import install_error_handlers
from backend.server.roles import (
    RoleRuntime,
    build_decode,
    build_prefill,
    build_unified,
    refuse_open_channel,
)
from backend.server.tracing import install_tracing
from contracts.engine import Role
from contracts.http_edge import BodyGuardMiddleware
from contracts.settings import RunMode

_BUILDERS = {Role.UNIFIED: build_unified, Role.PREFILL: build_prefill, Role.DECODE: build_decode}


def create_app(settings: BackendSettings, role: Role = Role.UNIFIED) -> FastAPI:
    if role is Role.PREFILL and settings.mode is RunMode.PRODUCTION and not settings.decode_peers:
        raise ValueError("KVGUARD_DECODE_PEERS is required for a production prefill role")
    if role is not Role.UNIFIED:
        refuse_open_channel(settings)
    runtime = _BUILDERS[role](settings)
    service = runtime.service

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.engine.start()
        try:
            await runtime.start()
            yield
        finally:
            await runtime.stop()
            await service.engine.stop()
            for close in runtime.closers:
                close()

    app = FastAPI(title=f"kvguard backend ({role.value})", lifespan=lifespan)
    app.state.service = service
    app.state.prefill = runtime.prefill
    app.state.decode_peers = DecodePeers(
        settings.decode_peers, accept_open=settings.kv_channel == "open"
    )
    app.add_middleware(
        BodyGuardMiddleware,
        max_bytes=settings.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
    )
    if settings.engine_token is not None:  # outermost: no body is read before the credential
        app.add_middleware(EngineAuthMiddleware, token=settings.engine_token.get_secret_value())
    install_error_handlers(app)
    _mount(app, runtime, role, settings)
    tracing = install_tracing(app, role=role.value, otlp_endpoint=settings.otlp_endpoint)
    if tracing is not None:
        provider, handoffs = tracing
        runtime.closers.append(provider.shutdown)  # flushes the spans still batched
        if runtime.handoff is not None:
            runtime.handoff.traced = handoffs.handoff
    return app


def _mount(app: FastAPI, runtime: RoleRuntime, role: Role, settings: BackendSettings) -> None:
    if role is Role.PREFILL:
        app.include_router(routes_handoff.router)
    else:
        app.include_router(routes_openai.router)
    app.include_router(routes_ops.router)
    if role is Role.DECODE and settings.allow_fault_drills:
        app.include_router(routes_drill.router)
