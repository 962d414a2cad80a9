"""``RequestContext.info``: what plug-ins (guards, hooks, the finish report) are told about a
request, built once and again only when the engine is chosen -- never stale."""

from __future__ import annotations

from opentelemetry.trace import INVALID_SPAN

from gateway.domain import Principal, TenantPlan
from gateway.engines.registry import EngineRecord, EngineSource
from gateway.engines.spec import EngineSpec
from gateway.proxy.context import RequestContext
from gateway.upstream.base import Endpoint

PRINCIPAL = Principal(
    tenant_id="t1",
    tenant_name="alice",
    key_id=1,
    key_prefix="p1",
    plan=TenantPlan(),
    synthetic=True,
    canary_sample_rate=0.25,
    key_last_used_at=None,
)


def test_info_follows_the_engine_and_is_reused_between_changes() -> None:
    ctx = RequestContext(
        request_id="r1",
        principal=PRINCIPAL,
        endpoint=Endpoint.CHAT,
        model="m",
        stream=False,
        span=INVALID_SPAN,
    )
    before = ctx.info()
    assert (before.request_id, before.tenant_id, before.model) == ("r1", "t1", "m")
    assert (before.endpoint, before.synthetic, before.canary_sample_rate) == (
        Endpoint.CHAT.value,
        True,
        0.25,
    )
    assert before.engine is None
    assert ctx.info() is before
    ctx.engine = EngineRecord(
        EngineSpec(name="e1", base_url="http://127.0.0.1:1"), EngineSource.CONFIG
    )
    after = ctx.info()
    assert after.engine == "e1"
    assert (after.request_id, after.tenant_id, after.endpoint) == ("r1", "t1", Endpoint.CHAT.value)
    assert ctx.info() is after
    ctx.engine = EngineRecord(
        EngineSpec(name="e2", base_url="http://127.0.0.1:2"), EngineSource.CONFIG
    )
    assert ctx.info().engine == "e2"
    assert ctx.report(status=200).info.engine == "e2"
