"""Capacity truth (pure): max_request_tokens, drift, fits, and registry assessment."""

from __future__ import annotations

from gateway.engines.capacity import (
    CapacitySnapshot,
    RequestSize,
    RoleView,
    fits,
    max_request_tokens_for,
)
from gateway.engines.registry import (
    EngineBlock,
    EngineControls,
    EngineRegistry,
    EngineSource,
    assess,
)
from gateway.engines.spec import EngineSpec


def snap(window: int, *pools: int | None, **kw) -> CapacitySnapshot:
    roles = tuple(RoleView(role=f"r{i}", pool_tokens=p) for i, p in enumerate(pools))
    return CapacitySnapshot(model="m", context_window=window, roles=roles, measured=True, **kw)


def test_max_request_tokens_is_the_smallest_real_limit() -> None:
    incident = snap(1_048_576, 681_280)
    assert incident.max_request_tokens == 681_280
    assert incident.drift == (
        "context window 1048576 exceeds the r0 role's real KV pool of 681280 tokens; "
        "requests are limited to 681280 tokens"
    )
    disagg = snap(8192, 20_000, 6_000)
    assert (disagg.max_request_tokens, disagg.real_pool) == (6_000, 6_000)
    assert "r1 role's real KV pool of 6000" in (disagg.drift or "")
    healthy = snap(4096, 8192, reported_max_request_tokens=4000)
    assert (healthy.max_request_tokens, healthy.drift) == (4000, None)
    engine_says = snap(4096, 8192, engine_drift="allow_capacity_drift set")
    assert engine_says.drift == "allow_capacity_drift set"
    role_limit = CapacitySnapshot(
        model="m",
        context_window=4096,
        measured=True,
        roles=(RoleView(role="decode", pool_tokens=9000, max_request_tokens=3000),),
    )
    assert role_limit.max_request_tokens == 3000


def test_fits_at_the_boundary_and_plan_cap() -> None:
    s = snap(1_048_576, 681_280)
    assert fits(s, RequestSize(681_279 - 16, 16), None)
    assert fits(s, RequestSize(681_280 - 16, 16), None)
    assert not fits(s, RequestSize(681_281 - 16, 16), None)
    assert max_request_tokens_for(s, 1000) == 1000 and max_request_tokens_for(s, None) == 681_280
    assert not fits(s, RequestSize(990, 11), 1000)
    prompt_cap = snap(100, 100, max_prompt_tokens=50)
    assert fits(prompt_cap, RequestSize(50, 50), None)
    assert not fits(prompt_cap, RequestSize(51, 1), None)


def test_unknown_pool_is_not_known() -> None:
    assert not snap(4096, None).pool_known
    assert not snap(4096, 8192, None).pool_known
    assert snap(4096, 8192).pool_known


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _registry(clock: Clock, *specs: EngineSpec) -> EngineRegistry:
    registry = EngineRegistry(stale_after_s=15.0, clock=clock)
    registry.set_specs([(spec, EngineSource.CONFIG) for spec in specs])
    return registry


def test_assessment_fails_closed() -> None:
    clock = Clock()
    spec = EngineSpec(name="e", base_url="http://e")
    registry = _registry(clock, spec)
    record = registry.get("e")
    assert record is not None
    assert registry.block(record) is EngineBlock.UNKNOWN_CAPACITY
    registry.record_success("e", snap(4096, 8192))
    assert registry.block(record) is None
    clock.now += 15.1
    assert registry.block(record) is EngineBlock.STALE_CAPACITY
    registry.set_controls("e", EngineControls(allow_unsafe=True))
    assert registry.block(record) is None  # an explicit admin override
    registry.record_success("e", snap(4096, 8192, faults=("legacy_handoff",)))
    registry.set_controls("e", EngineControls())
    assert registry.block(record) is EngineBlock.FAULT_DRILL
    registry.set_controls("e", EngineControls(quarantine_reason="leak", allow_unsafe=True))
    assert registry.block(record) is EngineBlock.QUARANTINED  # never overridden
    registry.set_controls("e", EngineControls())
    registry.record_success("e", snap(4096, 8192))
    registry.record_failure("e", "GET /engine/capacity: ConnectError")
    assert registry.block(record) is EngineBlock.UNREACHABLE
    registry.record_success("e", snap(4096, None))
    assert registry.block(record) is EngineBlock.UNKNOWN_CAPACITY


def test_declared_capacity_needs_allow_unverified() -> None:
    declared = CapacitySnapshot(
        model="m", context_window=100, roles=(RoleView("declared", 100),), measured=False
    )
    clock = Clock()
    for allow, expected in ((False, EngineBlock.UNVERIFIED), (True, None)):
        spec = EngineSpec(
            name="d",
            kind="openai",
            base_url="http://d",
            model="m",
            declared_max_model_len=100,
            allow_unverified=allow,
        )
        registry = _registry(clock, spec)
        registry.record_success("d", declared)
        record = registry.get("d")
        assert record is not None
        assert assess(record, now=clock.now, stale_after_s=15) is expected


def test_routing_least_in_flight_then_round_robin() -> None:
    clock = Clock()
    specs = [EngineSpec(name=n, base_url=f"http://{n}") for n in ("a", "b", "c")]
    registry = _registry(clock, *specs)
    for name in ("a", "b", "c"):
        registry.record_success(name, snap(4096, 8192))
    records = registry.records()
    assert [registry.choose(records).name for _ in range(6)] == ["a", "b", "c", "a", "b", "c"]
    records[0].in_flight = 1
    records[2].in_flight = 1
    assert {registry.choose(records).name for _ in range(4)} == {"b"}
    routable, blocked = registry.serving("m")
    assert ([r.name for r in routable], blocked) == (["a", "b", "c"], [])
    assert registry.serving("other") == ([], [])


def test_set_specs_keeps_state_of_unchanged_engines() -> None:
    clock = Clock()
    a = EngineSpec(name="a", base_url="http://a")
    registry = _registry(clock, a)
    registry.record_success("a", snap(4096, 8192))
    registry.set_controls("a", EngineControls(quarantine_reason="x"))
    registry.set_specs(
        [(a, EngineSource.CONFIG), (EngineSpec(name="b", base_url="http://b"), EngineSource.ADMIN)]
    )
    kept = registry.get("a")
    assert kept is not None and kept.snapshot is not None
    assert kept.controls.quarantine_reason == "x"
    moved = EngineSpec(name="a", base_url="http://elsewhere")
    registry.set_specs([(moved, EngineSource.CONFIG)])
    fresh = registry.get("a")
    assert fresh is not None and fresh.snapshot is None  # a new URL is a new engine to measure
    assert [r.name for r in registry.records()] == ["a"]
