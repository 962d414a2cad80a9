"""The engine's FastAPI application: built from settings in ``create_app``, started in the lifespan.

Start-up: build the engine (model, real pool, limits) -> start its loop thread -> serve.
Shutdown: stop accepting, abort what is in flight (each client gets a terminal event), join.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from backend.config import BackendSettings
from backend.engine.build import BuiltEngine, build_engine
from backend.server import routes_openai, routes_ops
from backend.server.errors import BodyGuardMiddleware, install_error_handlers
from backend.server.schema import Role
from backend.server.service import EngineService


def make_service(built: BuiltEngine, settings: BackendSettings, role: Role) -> EngineService:
    limits = built.limits
    metrics = built.metrics
    metrics.pool_tokens.set(limits.pool_tokens)
    metrics.context_window.set(limits.context_window)
    metrics.max_request_tokens.set(limits.max_request_tokens)
    metrics.capacity_drift.set(1 if limits.drift else 0)
    return EngineService(
        engine=built.engine,
        tokenizer=built.tokenizer,
        model_name=settings.served_model_name or settings.model.name,
        role=role,
        limits=limits,
        pool=built.pool,
        metrics=metrics,
        render_chat=lambda messages: built.render_chat([m.model_dump() for m in messages]),
        zero_on_free=settings.zero_on_free,
        request_timeout_s=settings.request_timeout_s,
    )


def create_app(settings: BackendSettings, role: Role = Role.UNIFIED) -> FastAPI:
    built = build_engine(settings, role=role.value)
    service = make_service(built, settings, role)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.engine.start()
        try:
            yield
        finally:
            await service.engine.stop()

    app = FastAPI(title=f"kvguard backend ({role.value})", lifespan=lifespan)
    app.state.service = service
    app.add_middleware(BodyGuardMiddleware, max_bytes=settings.max_body_bytes)
    install_error_handlers(app)
    app.include_router(routes_openai.router)
    app.include_router(routes_ops.router)
    return app
