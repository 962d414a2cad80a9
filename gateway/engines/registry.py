"""The engine registry: every known engine, its last capacity snapshot, and whether it may serve.

Lifecycle of an engine record: added (config or admin API) -> polled (success stores a snapshot,
failure records the error) -> assessed on every request -> removed (admin API only).

An engine is routable only with positive evidence (fail closed). ``assess`` returns why not:

- QUARANTINED: an admin (or the canary) took it out; nothing overrides this but clearing it.
- UNREACHABLE: the last poll failed.
- UNAVAILABLE: the engine itself says its serving path cannot serve (e.g. decode lost prefill).
- UNKNOWN_CAPACITY: never measured, or a pool could not be read.
- STALE_CAPACITY: the last good snapshot (plus the age of the engine's own view of its peer
  roles) is older than ``stale_after_s``.
- FAULT_DRILL: the engine reports a fault drill enabled.
- UNVERIFIED: capacity was declared in config, not measured, and the spec does not allow that.

STALE_CAPACITY and FAULT_DRILL can be overridden per engine by an explicit admin ``allow_unsafe``.
Drift is not a block: the limit already is the real pool; it is flagged (health, admin, metric).
``detail`` says, for the operator, what exactly blocks an engine (which member of a group, which
pool, what to enable); tenants only ever see the block reason.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from gateway.engines.capacity import CapacitySnapshot
from gateway.engines.spec import EngineSpec


class EngineBlock(StrEnum):
    QUARANTINED = "quarantined"
    UNREACHABLE = "unreachable"
    UNAVAILABLE = "unavailable"
    UNKNOWN_CAPACITY = "unknown_capacity"
    STALE_CAPACITY = "stale_capacity"
    FAULT_DRILL = "fault_drill"
    UNVERIFIED = "unverified"


OVERRIDABLE = frozenset({EngineBlock.STALE_CAPACITY, EngineBlock.FAULT_DRILL})


class EngineSource(StrEnum):
    CONFIG = "config"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class EngineControls:
    quarantine_reason: str | None = None
    allow_unsafe: bool = False


@dataclass(slots=True)
class EngineRecord:
    spec: EngineSpec
    source: EngineSource
    snapshot: CapacitySnapshot | None = None
    observed_at: float | None = None  # monotonic time of the last good snapshot
    last_error: str | None = None
    controls: EngineControls = field(default_factory=EngineControls)
    in_flight: int = 0

    @property
    def name(self) -> str:
        return self.spec.name


def assess(record: EngineRecord, *, now: float, stale_after_s: float) -> EngineBlock | None:
    """Why this engine must not serve now, or None when it may."""
    if record.controls.quarantine_reason is not None:
        return EngineBlock.QUARANTINED
    if record.last_error is not None:
        return EngineBlock.UNREACHABLE
    snapshot = record.snapshot
    if snapshot is None or record.observed_at is None or not snapshot.pool_known:
        return EngineBlock.UNKNOWN_CAPACITY
    if snapshot.unavailable is not None:
        return EngineBlock.UNAVAILABLE
    if not snapshot.measured and not record.spec.allow_unverified:
        return EngineBlock.UNVERIFIED
    blocks = []
    if now - record.observed_at + snapshot.oldest_role_age_s > stale_after_s:
        blocks.append(EngineBlock.STALE_CAPACITY)
    if snapshot.faults:
        blocks.append(EngineBlock.FAULT_DRILL)
    if blocks and not record.controls.allow_unsafe:
        return blocks[0]
    return None


def block_detail(
    record: EngineRecord, block: EngineBlock | None, *, age_s: float | None
) -> str | None:
    """The operator's version of ``block``: what exactly is wrong and, where known, the fix."""
    snapshot = record.snapshot
    if block is None:
        return None
    if block is EngineBlock.QUARANTINED:
        return record.controls.quarantine_reason
    if block is EngineBlock.UNREACHABLE:
        return record.last_error
    if block is EngineBlock.UNAVAILABLE:
        return snapshot.unavailable if snapshot else None
    if block is EngineBlock.UNKNOWN_CAPACITY:
        return (snapshot.unknown_pools if snapshot else None) or "capacity never measured yet"
    if block is EngineBlock.STALE_CAPACITY:
        return f"last good capacity is {age_s or 0.0:.1f} s old"
    if block is EngineBlock.FAULT_DRILL:
        return "fault drills enabled: " + ", ".join(snapshot.faults if snapshot else ())
    return "capacity is declared, not measured: set allow_unverified to route anyway"


class EngineRegistry:
    def __init__(self, *, stale_after_s: float, clock: Callable[[], float] = time.monotonic):
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._records: dict[str, EngineRecord] = {}
        self._turn = itertools.count()

    # -- membership -------------------------------------------------------------------------
    def set_specs(self, specs: list[tuple[EngineSpec, EngineSource]]) -> None:
        """Make the registry hold exactly these engines; unchanged specs keep their state."""
        fresh: dict[str, EngineRecord] = {}
        for spec, source in specs:
            old = self._records.get(spec.name)
            if old is not None and old.spec == spec:
                old.source = source
                fresh[spec.name] = old
            else:
                controls = old.controls if old is not None else EngineControls()
                fresh[spec.name] = EngineRecord(spec=spec, source=source, controls=controls)
        self._records = fresh

    def apply_controls(self, controls: dict[str, EngineControls]) -> None:
        for name, record in self._records.items():
            record.controls = controls.get(name, EngineControls())

    def set_controls(self, name: str, controls: EngineControls) -> None:
        record = self._records.get(name)
        if record is not None:
            record.controls = controls

    def get(self, name: str) -> EngineRecord | None:
        return self._records.get(name)

    def records(self) -> list[EngineRecord]:
        return list(self._records.values())

    # -- polling results --------------------------------------------------------------------
    def record_success(self, name: str, snapshot: CapacitySnapshot) -> None:
        record = self._records.get(name)
        if record is not None:
            record.snapshot, record.observed_at, record.last_error = snapshot, self._clock(), None

    def record_failure(self, name: str, error: str) -> None:
        record = self._records.get(name)
        if record is not None:
            record.last_error = error

    # -- routing ----------------------------------------------------------------------------
    def block(self, record: EngineRecord) -> EngineBlock | None:
        return assess(record, now=self._clock(), stale_after_s=self._stale_after_s)

    def detail(self, record: EngineRecord) -> str | None:
        return block_detail(record, self.block(record), age_s=self.capacity_age_s(record))

    def capacity_age_s(self, record: EngineRecord) -> float | None:
        return None if record.observed_at is None else self._clock() - record.observed_at

    def serving(self, model: str) -> tuple[list[EngineRecord], list[EngineRecord]]:
        """(routable, blocked) engines whose last snapshot (or declared model) is ``model``."""
        routable: list[EngineRecord] = []
        blocked: list[EngineRecord] = []
        for record in self._records.values():
            if model_of(record) != model:
                continue
            (blocked if self.block(record) is not None else routable).append(record)
        return routable, blocked

    def routable_models(self) -> dict[str, list[EngineRecord]]:
        models: dict[str, list[EngineRecord]] = {}
        for record in self._records.values():
            model = model_of(record)
            if model is not None and self.block(record) is None:
                models.setdefault(model, []).append(record)
        return models

    def choose(self, fitting: list[EngineRecord]) -> EngineRecord:
        """Least in-flight requests first; ties broken round-robin."""
        least = min(record.in_flight for record in fitting)
        tied = [record for record in fitting if record.in_flight == least]
        return tied[next(self._turn) % len(tied)]


def model_of(record: EngineRecord) -> str | None:
    if record.snapshot is not None:
        return record.snapshot.model
    return record.spec.model
