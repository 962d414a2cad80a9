"""Per-tenant latency as the gateway relays it: time to first token and the gaps between tokens.

Lifecycle: while a stream is relayed, ``StreamRelay`` counts the engine events that carry answer
text; after each event ``tick`` compares that count with the one it saw last. The first text
event observes the tenant's TTFT (request arrival -> now), every later one the gap since the
previous text event (inter-token latency), so a stream of N text events gives one TTFT and N - 1
gaps. A text event held back by a guard still counts: the clock follows the engine's cadence
through the gateway, not the firewall's buffering. A non-streamed answer observes only its TTFT
(the whole answer arrives at once), labelled ``stream="false"`` so it never mixes with streamed
percentiles. Labels carry the tenant id, never content.
"""

from __future__ import annotations

from gateway.proxy.context import RequestContext
from gateway.proxy.deps import ProxyDeps


def tick(deps: ProxyDeps, ctx: RequestContext, text_events: int) -> None:
    """Observe the latency of the text events seen since the last call (at most one per event)."""
    if text_events == ctx.text_events:
        return
    now = ctx.elapsed_s()
    if ctx.last_text_s is None:
        tenant = ctx.principal.tenant_id
        deps.metrics.tenant_ttft_seconds.labels(tenant=tenant, stream="true").observe(now)
        # the tenant's gap histogram, looked up once per stream, not once per event
        ctx.inter_token = deps.metrics.inter_token_seconds.labels(tenant=tenant)
    elif ctx.inter_token is not None:
        ctx.inter_token.observe(now - ctx.last_text_s)
    ctx.text_events = text_events
    ctx.last_text_s = now


def answered(deps: ProxyDeps, ctx: RequestContext) -> None:
    """A whole (non-streamed) answer is about to be sent: its first token arrives with it."""
    tenant = ctx.principal.tenant_id
    deps.metrics.tenant_ttft_seconds.labels(tenant=tenant, stream="false").observe(ctx.elapsed_s())
