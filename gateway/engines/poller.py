"""The capacity poller: introspects every engine on start and then every ``interval_s``.

Two loops, every ``interval_s``: ``run`` introspects all engines concurrently (each bounded by a
timeout), stores snapshots or errors in the registry and publishes per-engine gauges (routable,
block reason, window/pool/enforced tokens, drift, faults, age); ``run_reload`` reloads the
admin-registered engines and controls from the database (so replicas converge). They are apart
so that a database that does not answer never delays a capacity poll: the engines stay fresh
(and routable) through a database outage. A failed introspection keeps the old snapshot for
reference but blocks routing at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import httpx

from contracts import grid
from gateway.engines.adapters import AdapterError, adapter_for
from gateway.engines.registry import EngineBlock, EngineRecord, EngineRegistry
from gateway.metrics import GatewayMetrics

log = logging.getLogger("kvguard.gateway.engines")

Reload = Callable[[], Awaitable[None]]


class CapacityPoller:
    def __init__(
        self,
        *,
        registry: EngineRegistry,
        client: httpx.AsyncClient,
        metrics: GatewayMetrics,
        interval_s: float,
        timeout_s: float,
        reload: Reload | None = None,
    ) -> None:
        self._registry = registry
        self._client = client
        self._metrics = metrics
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self.reload = reload  # set after construction when it needs the app state

    async def run(self) -> None:
        while True:
            await grid.sleep(self._interval_s)
            try:
                await self.poll_once()
            except Exception:  # the loop must outlive any single bad cycle
                log.exception("capacity poll cycle failed")

    async def run_reload(self) -> None:
        while True:
            await grid.sleep(self._interval_s)
            await self.reload_once()

    async def reload_once(self) -> None:
        if self.reload is None:
            return
        try:
            await self.reload()
        except Exception as exc:
            log.warning(
                "could not reload engines from the database (%s); keeping the last set", exc
            )

    async def poll_once(self) -> None:
        records = self._registry.records()
        await asyncio.gather(*(self._poll(record) for record in records))
        self.publish()

    async def _poll(self, record: EngineRecord) -> None:
        adapter = adapter_for(record.spec)
        try:
            snapshot = await adapter.introspect(self._client, timeout=self._timeout_s)
        except AdapterError as exc:
            self._failed(record, str(exc))
            return
        except Exception as exc:  # an adapter bug must not stop other engines' polls
            log.exception("adapter for %s raised", record.name)
            self._failed(record, f"adapter error: {exc.__class__.__name__}")
            return
        if record.last_error is not None:
            log.info("engine %s answers again", record.name)
        self._registry.record_success(record.name, snapshot)
        if snapshot.drift:
            log.error("capacity drift on engine %s: %s", record.name, snapshot.drift)
        if snapshot.faults:
            log.error("engine %s reports fault drills enabled: %s", record.name, snapshot.faults)
        if snapshot.unknown_pools:
            log.warning("engine %s is not routable: %s", record.name, snapshot.unknown_pools)
        if snapshot.unavailable:
            log.warning("engine %s is unavailable: %s", record.name, snapshot.unavailable)

    def _failed(self, record: EngineRecord, error: str) -> None:
        if record.last_error != error:
            log.warning("engine %s capacity poll failed: %s", record.name, error)
        self._registry.record_failure(record.name, error)
        self._metrics.engine_poll_errors.labels(engine=record.name).inc()

    def publish(self) -> None:
        m = self._metrics
        for gauge in (m.engine_routable, m.engine_blocked, m.engine_capacity, m.engine_drift):
            gauge.clear()
        m.engine_faults.clear()
        m.engine_age.clear()
        for record in self._registry.records():
            block = self._registry.block(record)
            m.engine_routable.labels(engine=record.name).set(0 if block else 1)
            for reason in EngineBlock:
                m.engine_blocked.labels(engine=record.name, reason=reason.value).set(
                    1 if block is reason else 0
                )
            age = self._registry.capacity_age_s(record)
            if age is not None:
                m.engine_age.labels(engine=record.name).set(age)
            self._publish_snapshot(record)

    def _publish_snapshot(self, record: EngineRecord) -> None:
        snapshot, m = record.snapshot, self._metrics
        if snapshot is None:
            return
        name = record.name
        m.engine_capacity.labels(engine=name, role="all", kind="window").set(
            snapshot.context_window
        )
        m.engine_capacity.labels(engine=name, role="all", kind="enforced").set(
            snapshot.max_request_tokens
        )
        for role in snapshot.roles:
            if role.pool_tokens is not None:
                m.engine_capacity.labels(engine=name, role=role.role, kind="pool").set(
                    role.pool_tokens
                )
        m.engine_drift.labels(engine=name).set(1 if snapshot.drift else 0)
        m.engine_faults.labels(engine=name).set(len(snapshot.faults))
