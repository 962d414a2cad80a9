"""The gateway's FastAPI app: ``create_app(settings)``; all state is built in the lifespan.

Served by uvicorn with the data plane's protocol (``server_config``): the completion routes run
below FastAPI (``gateway.proxy.door``), the rest of the API on it.

Lifespan, in order: database (upgrade to head when ``migrate_on_start``) -> limiter (Redis when
``KVGUARD_REDIS_URL`` is set, else in-process) -> one shared HTTP client -> engine registry
(configured + admin-registered engines) and a first capacity poll -> background tasks (poller,
audit writer, lease refresh) -> hook services (the canary) -> for the process that serves, the
heap settled (``contracts.heap``). Shutdown runs the same list backwards, flushing audit rows last.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Literal

import anyio
import httpx
import uvicorn
from fastapi import FastAPI
from opentelemetry.sdk.trace.export import SpanExporter
from starlette.types import ASGIApp, Receive, Scope, Send

from contracts.heap import settle_heap
from contracts.http_edge import CLIENT_KEEP_ALIVE_S, BodyGuardMiddleware
from contracts.http_edge import server_config as edge_config
from contracts.plugins import GatewayHooks
from contracts.spool import Spool
from contracts.sql import make_session_factory
from gateway.api.request_ids import RequestIds
from gateway.api.routes import admin, embeddings, health, openai, tenant
from gateway.config import GatewaySettings
from gateway.console import mount_console
from gateway.db.link import Link
from gateway.db.session import make_engine, upgrade_database
from gateway.deps import renew_verified_keys
from gateway.engines.poller import CapacityPoller
from gateway.engines.registry import EngineRegistry
from gateway.errors import install_error_handlers
from gateway.limits.auth_throttle import FailedCredentialThrottle
from gateway.limits.base import Limiter
from gateway.limits.memory_limiter import MemoryLimiter
from gateway.limits.redis_limiter import RedisLimiter
from gateway.metrics import GatewayMetrics
from gateway.proxy.deps import ProxySettings
from gateway.proxy.door import ROUTES, CompletionRoutes
from gateway.proxy.server import DataPlaneProtocol, data_plane_protocol
from gateway.services import responses as stored_responses
from gateway.services.audit import AuditWriter
from gateway.services.auth_cache import LANE_LOOKUPS, AuthCache
from gateway.services.keys import LookupLinks
from gateway.services.quarantine import Quarantines
from gateway.state import GatewayState
from gateway.tracing import Tracing
from gateway.upstream.direct import DirectUpstream
from gateway.upstream.litellm_client import LiteLLMUpstream

log = logging.getLogger("kvguard.gateway")


def make_limiter(settings: GatewaySettings) -> Limiter:
    if settings.redis_url:
        return RedisLimiter(
            url=settings.redis_url,
            lease_s=settings.concurrency_lease_s,
            credit_s=settings.limiter_credit_s,
        )
    return MemoryLimiter()


def engine_client(settings: GatewaySettings) -> httpx.AsyncClient:
    """The client of the engines' control routes: capacity polls and token counts (completions
    go over ``gateway.upstream``)."""
    timeout = httpx.Timeout(
        settings.upstream_read_timeout_s, connect=settings.upstream_connect_timeout_s
    )
    # below the engines' own keep-alive (see CLIENT_KEEP_ALIVE_S): httpx's default is theirs
    limits = httpx.Limits(
        max_connections=1000, max_keepalive_connections=200, keepalive_expiry=CLIENT_KEEP_ALIVE_S
    )
    return httpx.AsyncClient(timeout=timeout, limits=limits, follow_redirects=False)


def _migrate(url: str) -> None:
    """Upgrade on an engine of its own: a migration may take longer than a request's bound."""
    engine = make_engine(url)
    try:
        upgrade_database(engine)
    finally:
        engine.dispose()


async def build_state(
    settings: GatewaySettings, *, hooks: GatewayHooks, span_exporter: SpanExporter | None
) -> GatewayState:
    if settings.migrate_on_start:
        await anyio.to_thread.run_sync(_migrate, settings.sqlalchemy_url())
    db = make_engine(settings.sqlalchemy_url(), timeout_s=settings.database_timeout_s)
    sessions = make_session_factory(db, timeout_s=settings.database_timeout_s)
    metrics = GatewayMetrics()
    client = engine_client(settings)
    registry = EngineRegistry(stale_after_s=settings.capacity_stale_after_s)
    poller = CapacityPoller(
        registry=registry,
        client=client,
        metrics=metrics,
        interval_s=settings.poll_interval_s,
        timeout_s=settings.engine_timeout_s,
    )
    state = GatewayState(
        settings=settings,
        db=db,
        sessions=sessions,
        limiter=make_limiter(settings),
        registry=registry,
        client=client,
        direct=DirectUpstream(
            connect_timeout_s=settings.upstream_connect_timeout_s,
            read_timeout_s=settings.upstream_read_timeout_s,
        ),
        litellm=LiteLLMUpstream(timeout_s=settings.upstream_read_timeout_s),
        audit=AuditWriter(
            session_factory=sessions,
            flush_interval_s=settings.audit_flush_interval_s,
            on_drop=metrics.audit_dropped.inc,
            on_set_aside=metrics.audit_set_aside.inc,
            spool=Spool(settings.spool_dir(), kind="audit"),
            link=Link.of(db, timeout_s=settings.database_timeout_s),
        ),
        metrics=metrics,
        tracing=Tracing(
            service_name=settings.service_name,
            otlp_endpoint=settings.otlp_endpoint,
            exporter=span_exporter,
        ),
        hooks=hooks,
        poller=poller,
        configured_engines=settings.engine_specs(),
        auth_cache=AuthCache(ttl_s=settings.auth_cache_ttl_s),
        credential_throttle=FailedCredentialThrottle(
            capacity=settings.operator_failures_per_minute, window_s=60.0
        ),
        quarantines=Quarantines(
            registry=registry,
            sessions=sessions,
            spool=Spool(settings.spool_dir(), kind="quarantine"),
            redis_url=settings.redis_url,
            retry_s=min(settings.poll_interval_s, 5.0),
            write_timeout_s=settings.database_timeout_s,
        ),
        proxy_settings=ProxySettings.of(settings),
        lookup_links=LookupLinks.of(
            db, timeout_s=settings.database_timeout_s, per_lane=LANE_LOOKUPS
        ),
    )
    poller.reload = state.reload_engines
    return state


async def start(state: GatewayState) -> list[asyncio.Task[None]]:
    limiter_tasks = await state.limiter.start()  # stopped by its close
    state.metrics.limiter_up.set(1 if await state.limiter.healthy() else 0)
    await state.poller.reload_once()
    await state.poller.poll_once()
    if state.lookup_links is not None:
        try:
            await state.lookup_links.open()
        except Exception as exc:
            log.warning("key lookup connections not made yet (%s); made on first use", exc)
    try:
        await state.audit.drain_spool()  # rows a previous shutdown could not write
    except Exception:
        log.exception("audit: spooled rows not written yet; retrying in the background")
    tasks = [
        asyncio.create_task(state.poller.run(), name="capacity-poller"),
        asyncio.create_task(state.poller.run_reload(), name="engine-reload"),
        asyncio.create_task(state.audit.run(), name="audit-writer"),
        asyncio.create_task(renew_verified_keys(state), name="key-renewal"),
        asyncio.create_task(state.quarantines.run(), name="quarantines"),
        asyncio.create_task(stored_responses.purge_loop(state.sessions), name="responses-purge"),
    ]
    for task in [*tasks, *limiter_tasks]:
        state.watch(task)
    return tasks


async def stop(state: GatewayState, tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        # one that ended with an error was reported when it ended (``GatewayState.watch``); the
        # rest of the stop (the audit rows, the quarantine spool) must still run
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    await state.audit.close()
    if state.lookup_links is not None:
        await state.lookup_links.close()
    await state.quarantines.close()
    await state.limiter.close()
    await state.direct.close()
    await state.client.aclose()
    state.tracing.shutdown()
    state.db.dispose()


class GatewayApp(FastAPI):
    """The gateway's ASGI app: the completion routes go to the data plane's own ASGI app
    (``gateway.proxy.door``, below FastAPI's routing, dependencies and middleware); every other
    route is FastAPI's, with ``RequestIds`` outermost (Starlette puts its error middleware, which
    answers a gateway bug's 500, outside every ``add_middleware`` layer)."""

    completions: CompletionRoutes | None = None
    header_timeout_s: float = 15.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.completions is not None and scope["type"] == "http" and scope["path"] in ROUTES:
            await self.completions(scope, receive, send)
            return
        await super().__call__(scope, receive, send)

    def build_middleware_stack(self) -> ASGIApp:
        return RequestIds(super().build_middleware_stack())

    @property
    def http_protocol(self) -> type[DataPlaneProtocol]:
        """The uvicorn protocol to serve this app with (``gateway.proxy.server``)."""
        return data_plane_protocol(header_timeout_s=self.header_timeout_s)


def server_config(
    app: GatewayApp,
    *,
    host: str,
    port: int,
    log_level: str = "warning",
    lifespan: Literal["auto", "on", "off"] = "auto",
) -> uvicorn.Config:
    """uvicorn with the data plane's protocol (the edge's guarded one, with the way below ASGI)."""
    config = edge_config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        header_timeout_s=app.header_timeout_s,
        lifespan=lifespan,
    )
    config.http = app.http_protocol
    return config


def create_app(
    settings: GatewaySettings,
    *,
    hooks: GatewayHooks | None = None,
    span_exporter: SpanExporter | None = None,
    settle: bool = False,
) -> GatewayApp:
    """``settle``: once started, freeze the heap (``contracts.heap``): for the process that serves
    (``kvguard gateway``), not for a test process that builds many apps."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = await build_state(
            settings, hooks=hooks or GatewayHooks(), span_exporter=span_exporter
        )
        app.state.gateway = state
        tasks = await start(state)
        started = []
        try:
            for service in state.hooks.services:
                await service.start(state.service_context())
                started.append(service)
            if settle:
                log.info("start-up heap settled: %d objects frozen", settle_heap())
            yield
        finally:
            for service in reversed(started):
                await service.stop()
            await stop(state, tasks)

    # no 307 from a path with a trailing slash to the one without (or back): an OpenAI client
    # follows none, and OpenAI answers such a path as an unknown URL, as the error handlers do
    app = GatewayApp(
        title="kvguard gateway", version="0.1.0", lifespan=lifespan, redirect_slashes=False
    )
    app.header_timeout_s = settings.header_timeout_s
    app.completions = CompletionRoutes(
        app, max_body_bytes=settings.max_body_bytes, body_timeout_s=settings.body_timeout_s
    )
    install_error_handlers(app)
    app.add_middleware(
        BodyGuardMiddleware,
        max_bytes=settings.max_body_bytes,
        body_timeout_s=settings.body_timeout_s,
    )
    for router in (openai.router, embeddings.router, tenant.router, admin.router, health.router):
        app.include_router(router)
    for extra in hooks.routers if hooks is not None else []:
        app.include_router(extra)
    mount_console(app)  # the operator console, /console (gateway/console)
    return app
