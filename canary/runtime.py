"""The canary inside a gateway: injection, the leak firewall, findings, quarantine, metrics.

``CanaryRuntime(settings).hooks()`` is what ``create_app(settings, hooks=...)`` takes
(``kvguard gateway`` builds it from ``KVGUARD_CANARY_*``). Lifecycle:

1. built before the app (pure: keys, codec, ledger, tag index, metrics with their own registry);
2. ``start(context)`` in the gateway's lifespan (``ServiceContext``: the gateway's metrics
   registry, database sessions, Redis URL and engine quarantine, nothing else): metrics join the
   gateway's ``/metrics``, the marker records store opens (Redis when ``KVGUARD_REDIS_URL`` is
   set, else in-process), the tag index is loaded from the tenants table and refreshed every
   ``canary_tag_refresh_s``;
3. per request: ``MarkerInjector.prepare`` -> ``LeakFirewall.open`` (per choice) ->
   ``on_cut`` (a firewall cut, see below) -> ``on_finish`` (ledger entry and scanner factory
   dropped, record completed with the engine, lower-severity checks);
4. ``stop()``: record writes drained, background tasks stopped, store closed.

A cut always stops the answer; a quarantine needs evidence that the engine produced the marker
from another tenant's request (``Judged.why_not`` is None). First, a marker whose text stands in
the request's own input in any form ``canary.evidence`` detects is a *replay* (kind ``replay``,
high, no quarantine, not counted as a cut of the engine): the tenant sent it in and the engine
only wrote it back. Otherwise: a CONFIRMED ``cross_tenant`` finding (its MAC verifies, so this
deployment issued it for the tag of a tenant that is not the requester) whose issue record, when
it can be read, does not name a request served by another engine, quarantines. Suspected
(damaged-copy) findings quarantine when corroborated (``canary.corroboration``: copies showing
the victim's nonce, of requests this engine served, for several requesting tenants within a
window), or each one with ``canary_quarantine_on_suspected``; same-tenant ``cross_request`` ones
alert. The quarantine takes effect in this replica's memory first and reaches the others without
PostgreSQL (``gateway.services.quarantine``); every finding is kept on local disk until the
database has it (``canary.keeper``), and the one log line says whether it was stored or spooled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
from prometheus_client import CollectorRegistry

from canary.anomalies import Anomaly, FirstTokenCalibrator, usage_anomaly
from canary.config import CanarySettings
from canary.corroboration import Corroboration
from canary.evidence import input_echo
from canary.findings import NewFinding
from canary.firewall import CanaryCut, LeakFirewall, TagIndex
from canary.injection import MarkerInjector, MarkerLedger
from canary.keeper import FindingKeeper
from canary.kinds import Action, Evidence, FindingKind, severity_of
from canary.markers import MarkerCodec, encode_tag
from canary.metrics import CanaryMetrics
from canary.records import MarkerRecord, MemoryRecordStore, RecordStore, RedisRecordStore
from canary.scanner import Finding
from contracts import grid
from contracts.plugins import Cut, GatewayHooks, RequestInfo, RequestReport, ServiceContext
from contracts.sql import utcnow

log = logging.getLogger("kvguard.canary")


class _Forward:
    """Serves a private registry's metrics from another registry (the gateway's)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Any:
        return self._registry.collect()


class CanaryRuntime:
    def __init__(
        self,
        settings: CanarySettings,
        *,
        random: Callable[[], float] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.codec = MarkerCodec(settings.keyring())
        self.metrics = CanaryMetrics()
        self.ledger = MarkerLedger()
        self.tags = TagIndex(self.codec)
        self.injector = MarkerInjector(
            self.codec,
            ledger=self.ledger,
            known_tags=self.tags.lookup,
            records=lambda: self._store,
            metrics=self.metrics,
            inject_completions=settings.canary_inject_completions,
            random=random,
        )
        self.firewall = LeakFirewall(self.codec, ledger=self.ledger, tags=self.tags)
        self.first_token = FirstTokenCalibrator(
            min_prompt_tokens=settings.canary_ttft_min_prompt_tokens,
            ratio=settings.canary_ttft_ratio,
            history=settings.canary_ttft_history,
            min_samples=settings.canary_ttft_min_samples,
        )
        self.corroboration = Corroboration(
            window_s=settings.canary_corroboration_window_s,
            tenants=settings.canary_corroboration_tenants,
        )
        self._clock = clock
        self._last_low: dict[tuple[str, FindingKind], float] = {}
        self._gateway: ServiceContext | None = None
        self._store: RecordStore | None = None
        self._findings: FindingKeeper | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def hooks(self) -> GatewayHooks:
        from canary.api import build_router

        return GatewayHooks(
            request_hooks=[self.injector],
            guards=self.firewall,
            on_cut=self.on_cut,
            on_finish=self.on_finish,
            services=[self],
            routers=[build_router(self.metrics)],
        )

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self, context: ServiceContext) -> None:
        self._gateway = context
        context.metrics.register(_Forward(self.metrics.registry))
        ttl = self.settings.canary_record_ttl_s
        url = context.redis_url
        self._store = RedisRecordStore(url=url, ttl_s=ttl) if url else MemoryRecordStore(ttl_s=ttl)
        self._findings = FindingKeeper(
            spool_dir=context.spool_dir,
            sessions=context.sessions,
            timeout_s=context.database_timeout_s,
            retry_s=self.settings.canary_tag_refresh_s / 6,
            metrics=self.metrics,
        )
        self._tasks = [
            asyncio.create_task(self._findings.run(), name="canary-findings"),
            asyncio.create_task(self._refresh_loop(), name="canary-tag-refresh"),
        ]
        for task in self._tasks:
            context.watch(task)
        try:
            await self.refresh_tags()
        except Exception:
            log.exception("canary: tenant tags not loaded at start; the refresh loop retries")

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            # one that ended with an error was reported (``ServiceContext.watch``): stop the rest
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.injector.drain()
        if self._store is not None:
            await self._store.close()

    async def refresh_tags(self) -> None:
        gateway = self._require_gateway()
        ids = await gateway.tenant_ids()
        await anyio.to_thread.run_sync(self.tags.replace, ids)

    async def _refresh_loop(self) -> None:
        while True:
            await grid.sleep(self.settings.canary_tag_refresh_s)
            try:
                await self.refresh_tags()
            except Exception:
                log.exception("canary: tenant tag refresh failed; keeping the previous index")

    def _require_gateway(self) -> ServiceContext:
        if self._gateway is None:
            raise RuntimeError("the canary runtime has not been started")
        return self._gateway

    # -- a cut: the leak firewall stopped a response --------------------------------------------

    async def on_cut(self, info: RequestInfo, cut: Cut) -> None:
        if not isinstance(cut, CanaryCut):
            return
        gateway = self._require_gateway()
        engine = info.engine or "unknown"
        body = self.ledger.get(info.request_id).body
        judged = [await self._judge(info, finding, body) for finding in cut.findings]
        quarantine = (
            self.settings.canary_quarantine_on_cut
            and info.engine is not None
            and any(j.why_not is None for j in judged)
        )
        if quarantine and info.engine is not None:  # memory first, then every replica
            reason = f"canary: isolation finding on request {info.request_id}"
            await gateway.quarantine(info.engine, reason=reason)
            self.corroboration.forget(info.engine)
            self.metrics.quarantines.labels(engine=engine).inc()
        action = Action.CUT_AND_QUARANTINED if quarantine else Action.CUT
        news = [_isolation_finding(info, j, action) for j in judged]
        stored = await self._keeper().keep(news)
        for new in news:
            self.metrics.findings.labels(kind=new.kind.value, severity=new.severity.value).inc()
            replay = new.kind is FindingKind.REPLAY
            if not replay:  # a replay is the tenant's doing: no cut of the engine to count
                self.metrics.cuts.labels(engine=engine, kind=new.kind.value).inc()
            log.log(
                logging.WARNING if replay else logging.ERROR,
                "canary isolation finding (%s): kind=%s severity=%s evidence=%s engine=%s "
                "observer_tenant=%s observer_request=%s victim_tenant=%s victim_request=%s "
                "action=%s detail=%s",
                "stored" if stored else "spooled until the database answers",
                new.kind.value,
                new.severity.value,
                new.evidence.value,
                new.engine,
                new.observer_tenant_id,
                new.observer_request_id,
                new.victim_tenant_id,
                new.victim_request_id,
                new.action.value,
                new.detail,
            )

    async def _judge(self, info: RequestInfo, finding: Finding, body: Any) -> Judged:
        """The finding with its issue record and, when it must not quarantine, why not."""
        record = await self._record_of(finding)
        chars = self._marker_chars(finding)
        echo = None if body is None or chars is None else input_echo(body, chars)
        if echo is not None:
            why = f"the marker's text is in this request's own input ({echo}): a replay, not a leak"
            return Judged(finding, record, why, replay=True)
        why_not: str | None = None
        if finding.kind is not FindingKind.CROSS_TENANT:
            why_not = "another request of the same tenant: alerted, not quarantined"
        elif record is not None and record.engine not in (None, info.engine):
            why_not = f"the marker was issued for a request served by engine {record.engine}"
        elif finding.evidence is Evidence.SUSPECTED:
            why_not = self._uncorroborated(info, finding, record)
        return Judged(finding, record, why_not)

    def _uncorroborated(
        self, info: RequestInfo, finding: Finding, record: MarkerRecord | None
    ) -> str | None:
        """Why a suspected finding does not quarantine (yet), or None (``canary.corroboration``)."""
        if self.settings.canary_quarantine_on_suspected:
            return None
        window = self.settings.canary_corroboration_window_s
        counts = (
            info.engine is not None
            and finding.victim_nonce is not None
            and record is not None
            and record.engine == info.engine
        )
        if not counts or info.engine is None:
            return (
                "suspected only (a damaged copy has no MAC, and this one shows no nonce of a "
                "request this engine served): alerted, not quarantined"
            )
        tenants = self.corroboration.add(info.engine, info.tenant_id, now=self._clock())
        if self.corroboration.reached(tenants):
            return None
        return (
            f"suspected only (a damaged copy has no MAC): alerted; quarantined once copies of "
            f"markers this engine served reach {self.settings.canary_corroboration_tenants} "
            f"requesting tenants within {window:g} s ({tenants} so far)"
        )

    def _marker_chars(self, finding: Finding) -> str | None:
        if finding.evidence is Evidence.CONFIRMED and finding.key_id is not None:
            nonce = finding.victim_nonce
            if nonce is not None:
                return self.codec.body_of(finding.victim_tag, finding.key_id, nonce)
        return encode_tag(finding.victim_tag)

    async def _record_of(self, finding: Finding) -> MarkerRecord | None:
        if finding.victim_nonce is None or self._store is None:
            return None
        try:
            record = await self._store.get(finding.victim_nonce)
        except Exception as exc:
            self.metrics.record_errors.inc()
            log.warning("canary: marker record lookup failed: %s", exc)
            return None
        return victim_record(finding, record)

    def _keeper(self) -> FindingKeeper:
        if self._findings is None:
            raise RuntimeError("the canary runtime has not been started")
        return self._findings

    # -- the end of every request ---------------------------------------------------------------

    async def on_finish(self, report: RequestReport) -> None:
        info = report.info
        markers = self.ledger.pop(info.request_id)
        self.firewall.forget(info.request_id)
        if info.engine is None:
            return
        for nonce in markers.own | markers.carried:
            self.injector.record(nonce, info, engine=info.engine)
        for kind, anomaly in self._anomalies(report, info.engine):
            await self._low_finding(report, kind, anomaly)

    def _anomalies(self, report: RequestReport, engine: str) -> list[tuple[FindingKind, Anomaly]]:
        found: list[tuple[FindingKind, Anomaly]] = []
        gateway_count, engine_count = report.prompt_tokens, report.engine_prompt_tokens
        if (
            self.settings.canary_usage_check
            and gateway_count is not None
            and engine_count is not None
        ):
            usage = usage_anomaly(
                gateway_count=gateway_count, engine_count=engine_count, exact=report.exact_count
            )
            if usage is not None:
                found.append((FindingKind.USAGE_MISMATCH, usage))
        if (
            self.settings.canary_ttft_check
            and report.first_token_s is not None
            and gateway_count is not None
        ):
            fast = self.first_token.observe(
                engine, prompt_tokens=gateway_count, first_token_s=report.first_token_s
            )
            if fast is not None:
                found.append((FindingKind.FAST_FIRST_TOKEN, fast))
        return found

    async def _low_finding(
        self, report: RequestReport, kind: FindingKind, anomaly: Anomaly
    ) -> None:
        info = report.info
        engine = info.engine or "unknown"
        severity = severity_of(Evidence.MEASURED)
        self.metrics.findings.labels(kind=kind.value, severity=severity.value).inc()
        now = self._clock()
        last = self._last_low.get((engine, kind))
        if last is not None and now - last < self.settings.canary_finding_interval_s:
            return  # counted, not stored: one row per engine and kind per interval
        self._last_low[(engine, kind)] = now
        new = NewFinding(
            kind=kind,
            severity=severity,
            evidence=Evidence.MEASURED,
            action=Action.RECORDED,
            observer_tenant_id=info.tenant_id,
            engine=info.engine,
            observer_request_id=info.request_id,
            detail=anomaly.detail,
        )
        stored = await self._keeper().keep([new])
        log.warning(
            "canary finding (%s): kind=%s severity=low engine=%s tenant=%s request=%s",
            "stored" if stored else "spooled",
            kind.value,
            info.engine,
            info.tenant_id,
            info.request_id,
        )


@dataclass(frozen=True, slots=True)
class Judged:
    """A firewall finding, its victim's issue record, and why it does not quarantine (None: it
    does, with ``canary_quarantine_on_cut``); ``replay``: its marker stands in the request."""

    finding: Finding
    record: MarkerRecord | None
    why_not: str | None
    replay: bool = False


def victim_record(finding: Finding, record: MarkerRecord | None) -> MarkerRecord | None:
    """The issue record found for the finding's nonce, if it may name the victim's request. A
    confirmed nonce is authenticated by the MAC; a suspected one was read from a damaged copy, so
    its record counts only when it names the tenant the copy's tag names."""
    if record is None or finding.evidence is Evidence.CONFIRMED:
        return record
    return record if record.tenant_id == finding.victim_tenant else None


def _isolation_finding(info: RequestInfo, judged: Judged, action: Action) -> NewFinding:
    finding, record = judged.finding, judged.record
    kind = FindingKind.REPLAY if judged.replay else finding.kind
    return NewFinding(
        kind=kind,
        severity=severity_of(finding.evidence, kind),
        evidence=finding.evidence,
        action=action,
        observer_tenant_id=info.tenant_id,
        engine=info.engine,
        observer_request_id=info.request_id,
        victim_tenant_id=finding.victim_tenant or (record.tenant_id if record else None),
        victim_request_id=record.request_id if record else None,
        victim_engine=record.engine if record else None,
        key_id=finding.key_id,
        detail=judged.why_not,
        detected_at=utcnow(),
    )


def build_hooks(settings: CanarySettings) -> GatewayHooks | None:
    """The gateway's canary hooks from settings (None when the canary is turned off)."""
    if not settings.canary_enabled:
        log.warning("canary disabled (KVGUARD_CANARY_ENABLED=false): responses are not scanned")
        return None
    return CanaryRuntime(settings).hooks()
