"""Per-request state on the tenant path.

A ``RequestContext`` follows one request through the phases of ``gateway.lifecycle.Phase``; it
holds ids, counts and timings only (the prompt lives in the body, which it never references).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from opentelemetry.trace import Span

from contracts.engine import HandoffProof
from contracts.plugins import RequestInfo, RequestReport
from contracts.sql import utcnow
from gateway.domain import Principal
from gateway.engines.registry import EngineRecord
from gateway.lifecycle import Phase, check_transition
from gateway.limits.base import Lease
from gateway.proxy.stream import TokenClock
from gateway.tracing import Tracing
from gateway.upstream.base import Endpoint


@dataclass(slots=True)
class RequestContext:
    request_id: str
    principal: Principal
    endpoint: Endpoint
    model: str
    stream: bool
    span: Span
    upstream_span: Span | None = None  # the engine call's CLIENT span (gateway.tracing)
    started_mono: float = field(default_factory=time.perf_counter)
    started_at: datetime = field(default_factory=utcnow)
    phase: Phase = Phase.RECEIVED
    engine: EngineRecord | None = None  # set with the engine's in-flight slot taken (forwarding)
    lease: Lease | None = None
    answered: bool = False  # the engine answered 200 (a body or an open stream): it did work
    prompt_tokens: int | None = None  # the client's own: what it is billed and limited for
    hidden_prompt_tokens: int = 0  # added by request hooks (a canary marker): counted for capacity
    max_tokens: int | None = None
    completion_tokens: int | None = None
    handoff: HandoffProof | None = None
    first_byte_s: float | None = None
    forwarded_s: float | None = None
    engine_prompt_tokens: int | None = None  # the engine's own usage.prompt_tokens
    first_token_s: float | None = None  # forwarding -> first streamed text
    clock: TokenClock | None = None  # a relayed stream's text events (gateway.proxy.latency)
    finish_reasons: tuple[str, ...] = ()  # each choice's, as the engine ended it
    rate_limit_headers: dict[str, str] = field(default_factory=dict)  # x-ratelimit-*, at admission
    # ``info()`` as last built: the guards, the hooks and the report each ask for it
    _info: RequestInfo | None = field(default=None, init=False, repr=False, compare=False)

    def advance(self, phase: Phase) -> None:
        self.phase = check_transition(self.phase, phase)

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started_mono

    def info(self) -> RequestInfo:
        """The request as plug-ins see it; built again only once the engine is chosen (every
        other field is fixed when the context is made, and ``RequestInfo`` is frozen)."""
        engine = None if self.engine is None else self.engine.name
        info = self._info
        if info is None or info.engine != engine:
            info = self._info = RequestInfo(
                request_id=self.request_id,
                tenant_id=self.principal.tenant_id,
                model=self.model,
                endpoint=self.endpoint.value,
                synthetic=self.principal.synthetic,
                canary_sample_rate=self.principal.canary_sample_rate,
                engine=engine,
            )
        return info

    def report(self, *, status: int) -> RequestReport:
        return RequestReport(
            info=self.info(),
            outcome=self.phase.value,
            status=status,
            stream=self.stream,
            prompt_tokens=None
            if self.prompt_tokens is None
            else self.prompt_tokens + self.hidden_prompt_tokens,
            engine_prompt_tokens=self.engine_prompt_tokens,
            completion_tokens=self.completion_tokens,
            exact_count=self.engine is not None and self.engine.spec.introspected,
            first_token_s=self.first_token_s,
        )


def open_request(
    tracing: Tracing,
    *,
    request_id: str,
    principal: Principal,
    endpoint: Endpoint,
    model: str,
    stream: bool,
    incoming_headers: Mapping[str, str],
) -> RequestContext:
    """A tenant request's context, its SERVER span open (how every data-plane route starts)."""
    span = tracing.start_request(endpoint.path, model, incoming_headers)
    span.set_attribute("kvguard.tenant_id", principal.tenant_id)
    span.set_attribute("kvguard.request_id", request_id)
    return RequestContext(
        request_id=request_id,
        principal=principal,
        endpoint=endpoint,
        model=model,
        stream=stream,
        span=span,
    )
