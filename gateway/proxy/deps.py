"""What the request path uses, and nothing more: ``ProxyDeps`` (``GatewayState.proxy``).

The data plane (``gateway.proxy``) takes these few parts -- the limiter, the engine registry, the
upstream paths, the plug-in hooks, metrics, tracing, the audit writer and the handful of settings
it reads (``ProxySettings``) -- never the whole ``GatewayState``: a phase can only touch what is
named here.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from contracts.plugins import GatewayHooks
from gateway.config import GatewaySettings
from gateway.engines.registry import EngineRegistry
from gateway.engines.spec import EngineSpec, UpstreamPath
from gateway.limits.base import Limiter
from gateway.metrics import GatewayMetrics
from gateway.services.audit import AuditWriter
from gateway.tracing import Tracing
from gateway.upstream.base import Upstream


@dataclass(frozen=True, slots=True)
class ProxySettings:
    """The settings the request path reads (``GatewaySettings`` holds their documentation)."""

    refuse_on_handoff_mismatch: bool = True
    limiter_fail_open: bool = False
    default_max_tokens_cap: int | None = None
    engine_timeout_s: float = 5.0
    cache_salt: bytes = b""

    @classmethod
    def of(cls, settings: GatewaySettings) -> ProxySettings:
        return cls(
            refuse_on_handoff_mismatch=settings.refuse_on_handoff_mismatch,
            limiter_fail_open=settings.limiter_fail_open,
            default_max_tokens_cap=settings.default_max_tokens_cap,
            engine_timeout_s=settings.engine_timeout_s,
            cache_salt=settings.cache_salt_secret(),
        )


@dataclass(slots=True)
class ProxyDeps:
    settings: ProxySettings
    limiter: Limiter
    registry: EngineRegistry
    direct: Upstream  # an engine's OpenAI-compatible routes, bytes passed through
    litellm: Upstream  # providers that need translation
    client: httpx.AsyncClient  # an engine's tokenize route (counting), not completions
    hooks: GatewayHooks
    metrics: GatewayMetrics
    tracing: Tracing
    audit: AuditWriter

    def upstream_for(self, spec: EngineSpec) -> Upstream:
        return self.litellm if spec.upstream_path is UpstreamPath.LITELLM else self.direct
