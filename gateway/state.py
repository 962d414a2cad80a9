"""Everything one running gateway app holds, built in the lifespan and torn down with it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial

import httpx
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from contracts.plugins import GatewayHooks, ServiceContext
from contracts.sql import run_in_session, utcnow
from gateway.config import GatewaySettings
from gateway.engines.poller import CapacityPoller
from gateway.engines.registry import EngineRegistry
from gateway.engines.spec import EngineSpec
from gateway.limits.auth_throttle import FailedCredentialThrottle
from gateway.limits.base import Limiter
from gateway.metrics import GatewayMetrics
from gateway.proxy.deps import ProxyDeps, ProxySettings
from gateway.services import tenants as tenant_service
from gateway.services.audit import AuditWriter
from gateway.services.auth_cache import AuthCache
from gateway.services.engines import reload_registry
from gateway.services.keys import LookupLinks
from gateway.services.quarantine import Quarantines
from gateway.tracing import Tracing
from gateway.upstream.direct import DirectUpstream
from gateway.upstream.litellm_client import LiteLLMUpstream

log = logging.getLogger("kvguard.gateway")


@dataclass(slots=True)
class GatewayState:
    settings: GatewaySettings
    db: Engine
    sessions: sessionmaker[Session]
    limiter: Limiter
    registry: EngineRegistry
    client: httpx.AsyncClient
    direct: DirectUpstream
    litellm: LiteLLMUpstream
    audit: AuditWriter
    metrics: GatewayMetrics
    tracing: Tracing
    hooks: GatewayHooks
    poller: CapacityPoller
    configured_engines: list[EngineSpec]
    auth_cache: AuthCache
    credential_throttle: FailedCredentialThrottle
    quarantines: Quarantines
    proxy_settings: ProxySettings
    # the request path's key lookups on PostgreSQL (on the event loop); None: through sessions
    lookup_links: LookupLinks | None = None
    clock: Callable[[], datetime] = utcnow  # wall time of key expiry and the auth cache's TTL
    # background tasks that ended on their own (name -> why): each is a health problem
    ended_tasks: dict[str, str] = field(default_factory=dict)

    def watch(self, task: asyncio.Task[None]) -> None:
        """A background task runs until the gateway stops; one that ends by itself (a failure
        its loop did not catch) is logged and kept as a health problem, never silent."""
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        error = task.exception()
        # /health is public: the problem names the error's type; its text goes to the log only
        self.ended_tasks[task.get_name()] = "returned" if error is None else type(error).__name__
        log.critical(
            "background task %s ended; restart the gateway", task.get_name(), exc_info=error
        )

    @property
    def proxy(self) -> ProxyDeps:
        """The few parts the request path takes (``gateway.proxy.deps``), read at each request so
        a test that swaps an upstream path sees it used."""
        return ProxyDeps(
            settings=self.proxy_settings,
            limiter=self.limiter,
            registry=self.registry,
            direct=self.direct,
            litellm=self.litellm,
            client=self.client,
            hooks=self.hooks,
            metrics=self.metrics,
            tracing=self.tracing,
            audit=self.audit,
        )

    async def reload_engines(self) -> None:
        mark = self.quarantines.applied()
        await reload_registry(
            registry=self.registry,
            sessions=self.sessions,
            configured=self.configured_engines,
            engine_token=self.settings.engine_token,
            quarantined=await self.quarantines.overlay(),
        )
        self.quarantines.reapply(mark)  # no await since the registry was set: nothing routed

    async def quarantine(self, name: str, *, reason: str) -> None:
        """Take an engine out of routing now, on every replica (``Quarantines.impose``)."""
        await self.quarantines.impose(name, reason=reason)  # the database's copy may lag

    def service_context(self) -> ServiceContext:
        """What the hook services get (``GatewayHooks.services``): a few parts, not the state."""
        return ServiceContext(
            metrics=self.metrics.registry,
            sessions=self.sessions,
            tenant_ids=partial(run_in_session, self.sessions, tenant_service.tenant_ids),
            redis_url=self.settings.redis_url,
            quarantine=self.quarantine,
            spool_dir=self.settings.spool_dir(),
            database_timeout_s=self.settings.database_timeout_s,
            watch=self.watch,
        )
