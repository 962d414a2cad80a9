"""Applying a request's ``Ending`` once: ``finish`` (called from ``gateway.proxy.service``'s one
``finally``).

In order: the context moves to its terminal phase (once; later calls are no-ops), the concurrency
lease is released with its refund, the engine's in-flight slot is freed, then the audit row
(metadata only), metrics, the span, and the ``on_finish`` hook. Nothing cancels it: it runs after
the flight's watch has ended (``gateway.proxy.service.Flight.run``; an embeddings request has no
watch), and a cancellation that ended the flight (the client's, or the server's at shutdown) was
delivered once, to the flight.
"""

from __future__ import annotations

import logging

from gateway.lifecycle import TERMINAL, InvalidTransition, Phase
from gateway.proxy import latency
from gateway.proxy.context import RequestContext
from gateway.proxy.deps import ProxyDeps
from gateway.proxy.ending import INTERNAL, Ending, Refund
from gateway.services.audit import AuditRecord
from gateway.tracing import Tracing

log = logging.getLogger("kvguard.gateway.proxy")


def _refund(ctx: RequestContext, refund: Refund) -> int:
    if ctx.lease is None:
        return 0
    if refund is Refund.ALL:
        return ctx.lease.tokens
    if ctx.completion_tokens is not None and ctx.prompt_tokens is not None:
        # what was taken less what was used: max_tokens - completion for a completion (the
        # prompt is what was charged), the bound less usage.prompt_tokens for embeddings
        return max(0, ctx.lease.tokens - ctx.prompt_tokens - ctx.completion_tokens)
    return 0  # unknown use (client gone mid-stream): keep the charge


async def finish(deps: ProxyDeps, ctx: RequestContext, ending: Ending) -> None:
    if ctx.phase in TERMINAL:
        return
    try:
        ctx.advance(ending.phase)
    except InvalidTransition:  # a gateway bug: still release everything, and say so
        log.exception("request %s cannot end as %s", ctx.request_id, ending.phase.value)
        ending = INTERNAL
        ctx.advance(ending.phase)
    status, code = ending.status, ending.code
    if ctx.lease is not None:
        await deps.limiter.release(ctx.lease, unused_tokens=_refund(ctx, ending.refund))
    if ctx.engine is not None:
        ctx.engine.in_flight -= 1
        deps.metrics.later(deps.metrics.in_flight_of, (ctx.principal.tenant_id,), -1)
    _record(deps, ctx, status=status, code=code)
    if deps.hooks.on_finish is not None:
        try:
            await deps.hooks.on_finish(ctx.report(status=status))
        except Exception:
            log.exception("on_finish hook failed for request %s", ctx.request_id)


def _record(deps: ProxyDeps, ctx: RequestContext, *, status: int, code: str | None) -> None:
    tenant = ctx.principal.tenant_id
    m = deps.metrics
    duration = ctx.elapsed_s()
    endpoint = ctx.endpoint.value
    later = m.later  # applied when the metrics are read (``contracts.metrics.Tally``)
    later(m.requests_of, (tenant, endpoint, ctx.phase.value, code or ""))
    later(m.request_seconds_of, (endpoint,), duration)
    if ctx.engine is not None and ctx.first_byte_s is not None and ctx.stream:
        later(m.ttft_seconds_of, (ctx.engine.name,), ctx.first_byte_s)
    if ctx.phase is not Phase.REJECTED and ctx.engine is not None:
        if ctx.prompt_tokens is not None:
            later(m.tokens_of, (tenant, "prompt"), ctx.prompt_tokens)
        if ctx.completion_tokens is not None:
            later(m.tokens_of, (tenant, "completion"), ctx.completion_tokens)
    latency.record(deps, ctx)
    handoff = ctx.handoff
    deps.audit.record(
        AuditRecord(
            request_id=ctx.request_id,
            tenant_id=tenant,
            key_prefix=ctx.principal.key_prefix,
            endpoint=ctx.endpoint.value,
            model=ctx.model,
            engine=ctx.engine.name if ctx.engine is not None else None,
            stream=ctx.stream,
            prompt_tokens=ctx.prompt_tokens,
            max_tokens=ctx.max_tokens,
            completion_tokens=ctx.completion_tokens,
            outcome=ctx.phase.value,
            http_status=status,
            error_code=code,
            handoff_outcome=handoff.outcome if handoff else None,
            reserved_tokens=handoff.reserved_tokens if handoff else None,
            transferred_tokens=handoff.transferred_tokens if handoff else None,
            started_at=ctx.started_at,
            ttft_ms=None if ctx.first_byte_s is None else ctx.first_byte_s * 1000,
            duration_ms=duration * 1000,
        )
    )
    Tracing.end(
        ctx.span,
        ctx.upstream_span,
        outcome=ctx.phase.value,
        status=status,
        error_code=code,
        usage=(ctx.engine_prompt_tokens or ctx.prompt_tokens, ctx.completion_tokens),
        finish_reasons=ctx.finish_reasons,
    )
