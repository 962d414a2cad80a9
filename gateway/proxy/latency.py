"""Per-tenant latency as the gateway relays it: time to first token and the gaps between tokens.

Lifecycle: while a stream is relayed, its pump keeps the arrival times of the engine events that
carry answer text as a few numbers on the request (``gateway.proxy.stream.TokenClock``: the
first, the last, the gaps counted into the histogram's buckets); at the request's single exit
``record`` observes the tenant's TTFT (request arrival -> the first text event) and adds all of
the stream's gaps (inter-token latency) to the tenant's histogram at once, so a stream of N text
events gives one TTFT and N - 1 gaps. A text event held back by a guard still counts: the clock
follows the engine's cadence through the gateway, not the firewall's buffering. A non-streamed
answer observes only its TTFT when it is about to be sent (``answered``: the whole answer arrives
at once), labelled ``stream="false"`` so it never mixes with streamed percentiles. Labels carry
the tenant id, never content.
"""

from __future__ import annotations

from gateway.proxy.context import RequestContext
from gateway.proxy.deps import ProxyDeps


def record(deps: ProxyDeps, ctx: RequestContext) -> None:
    """A relayed stream's TTFT and gaps, once, at the request's exit."""
    clock = ctx.clock
    if clock is None or clock.first_s is None:
        return
    tenant = ctx.principal.tenant_id
    ttft = clock.first_s - ctx.started_mono
    deps.metrics.later(deps.metrics.tenant_ttft_seconds_of, (tenant, "true"), ttft)
    if clock.gaps:
        deps.metrics.inter_token_seconds.record(tenant, clock.counts, clock.gap_sum)


def answered(deps: ProxyDeps, ctx: RequestContext) -> None:
    """A whole (non-streamed) answer is about to be sent: its first token arrives with it."""
    m = deps.metrics
    m.later(m.tenant_ttft_seconds_of, (ctx.principal.tenant_id, "false"), ctx.elapsed_s())
