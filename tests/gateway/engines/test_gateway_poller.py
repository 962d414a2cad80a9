"""The capacity poller against the stand-in engine: snapshots, failures, faults, gauges."""

from __future__ import annotations

import httpx

from gateway.engines.poller import CapacityPoller
from gateway.engines.registry import EngineBlock, EngineRegistry, EngineSource
from gateway.engines.spec import EngineSpec
from gateway.metrics import GatewayMetrics


def _value(metrics: GatewayMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


async def test_poll_cycle_and_gauges(standin) -> None:
    now = [0.0]
    registry = EngineRegistry(stale_after_s=15, clock=lambda: now[0])
    spec = EngineSpec(name="e1", base_url=standin.url)
    down = EngineSpec(name="e2", base_url="http://127.0.0.1:9")  # nothing listens on port 9
    registry.set_specs([(spec, EngineSource.CONFIG), (down, EngineSource.CONFIG)])
    metrics = GatewayMetrics()
    standin.controls.context_window, standin.controls.pool_tokens = 8192, 2048
    async with httpx.AsyncClient() as client:
        poller = CapacityPoller(
            registry=registry, client=client, metrics=metrics, interval_s=5, timeout_s=2
        )
        await poller.poll_once()
        e1, e2 = registry.get("e1"), registry.get("e2")
        assert e1 is not None and e2 is not None
        assert registry.block(e1) is None
        assert registry.block(e2) is EngineBlock.UNREACHABLE
        assert e2.last_error is not None and e2.last_error.startswith("GET /engine/capacity")
        assert _value(metrics, "kvguard_gateway_engine_routable", engine="e1") == 1
        assert _value(metrics, "kvguard_gateway_engine_routable", engine="e2") == 0
        assert (
            _value(metrics, "kvguard_gateway_engine_blocked", engine="e2", reason="unreachable")
            == 1
        )
        assert _value(metrics, "kvguard_gateway_engine_capacity_drift", engine="e1") == 1
        for kind, role, value in (
            ("window", "all", 8192),
            ("enforced", "all", 2048),
            ("pool", "unified", 2048),
        ):
            assert (
                _value(
                    metrics,
                    "kvguard_gateway_engine_capacity_tokens",
                    engine="e1",
                    role=role,
                    kind=kind,
                )
                == value
            )
        assert _value(metrics, "kvguard_gateway_engine_poll_errors_total", engine="e2") == 1

        standin.controls.faults = ["release_at_abort"]
        now[0] = 3.0
        await poller.poll_once()
        assert registry.block(e1) is EngineBlock.FAULT_DRILL
        assert _value(metrics, "kvguard_gateway_engine_fault_drills", engine="e1") == 1
        assert _value(metrics, "kvguard_gateway_engine_capacity_age_seconds", engine="e1") == 0

        standin.controls.faults = []
        standin.controls.capacity_status = 503
        await poller.poll_once()
        assert registry.block(e1) is EngineBlock.UNREACHABLE  # blocked at once, not when stale
        assert e1.snapshot is not None  # the last snapshot stays for reference
        standin.controls.capacity_status = 200
        await poller.poll_once()
        assert registry.block(e1) is None
        now[0] = 20.0
        poller.publish()
        assert registry.block(e1) is EngineBlock.STALE_CAPACITY
        assert _value(metrics, "kvguard_gateway_engine_capacity_age_seconds", engine="e1") == 17
