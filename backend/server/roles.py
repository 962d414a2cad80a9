"""Assembling each role from settings: engine, faults, transport, handoff, and its lifespan hooks.

- unified: the engine alone.
- prefill: the engine with a ``Stager`` after each forward, a staging area (registered with the
  transport on the open channel only), and the ``PrefillService`` behind ``/kv/v1/*``.
- decode: the engine with a ``DecodeScheduler`` and ``DecodeEngineCore``, its landing slots (the
  sealed channel: registered per handoff; the open channel registers the KV pools instead), a
  ``HandoffDriver`` and the ``PrefillMonitor`` (prefill's capacity, polled, the announcement of
  decode's transfer target, and the cross-role admission). The drain bound is derived from the
  transfer-batch limit.

The transfer port listens where the deployment says (``transfer_bind``, by default the role's own
address); Mooncake cannot be told (it listens on every interface), so production refuses it unless
``transfer_bind`` says so too, and development says so in a warning.

Enabled fault drills are refused without ``allow_fault_drills`` and announced loudly (ERROR log,
``kvguard_engine_fault_drill_enabled{fault}``, ``/engine/capacity`` ``faults``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx

from backend.config import WILDCARD_ADDRESSES, BackendSettings
from backend.core.scheduler import Scheduler
from backend.disagg.channel import LandingSlots
from backend.disagg.decode_core import DecodeEngineCore, DecodeHandoffConfig, Notice
from backend.disagg.decode_driver import HandoffDriver
from backend.disagg.decode_scheduler import DecodeScheduler
from backend.disagg.faults import FaultSet
from backend.disagg.kvio import StagingArea, layout_of
from backend.disagg.machines import drain_bound_s
from backend.disagg.prefill import PrefillConfig, PrefillService, Stager
from backend.disagg.protocol import (
    PROTOCOL_VERSION,
    DecodeAnnouncement,
    KvChannel,
    TransferTarget,
)
from backend.engine.build import BuiltEngine, build_engine
from backend.engine.runner import ModelRunner
from backend.metrics import EngineMetrics
from backend.model.chat import countable_tokenizer
from backend.model.kv_cache import KVCache
from backend.model.snapshot import default_served_name
from backend.server.prefill_client import HttpPrefillChannel, PrefillLink, PrefillMonitor
from backend.server.service import EngineService
from backend.server.tracing import HANDOFF_HOOKS
from backend.transport.base import KvTransport, TransportUnavailable
from contracts.engine import Role
from contracts.http_edge import CLIENT_KEEP_ALIVE_S
from contracts.settings import RunMode

log = logging.getLogger("kvguard.backend")

Hook = Callable[[], Awaitable[None]]


async def _nothing() -> None:
    return None


@dataclass(slots=True)
class RoleRuntime:
    """A built role: what the routes use, and what the lifespan starts and stops around it."""

    service: EngineService
    start: Hook = _nothing  # after the engine loop started
    stop: Hook = _nothing  # before the engine loop stops
    prefill: PrefillService | None = None
    closers: list[Callable[[], None]] = field(default_factory=list)
    handoff: HandoffDriver | None = None  # decode: sends the handoffs (the app traces them)


def make_service(built: BuiltEngine, settings: BackendSettings, role: Role) -> EngineService:
    limits = built.limits
    metrics = built.metrics
    metrics.pool_tokens.set(limits.pool_tokens)
    metrics.context_window.set(limits.context_window)
    metrics.max_request_tokens.set(limits.max_request_tokens)
    metrics.capacity_drift.set(1 if limits.drift else 0)
    metrics.mode.labels(settings.mode.value).set(1)
    return EngineService(
        engine=built.engine,
        tokenizer=built.tokenizer,
        model_name=settings.served_model_name or default_served_name(settings.model),
        role=role,
        limits=limits,
        pool=built.pool,
        metrics=metrics,
        chat=built.render_chat,
        zero_on_free=built.pool.zero_on_free,
        request_timeout_s=settings.request_timeout_s,
        protocol_version=protocol_version(settings),
        tokenizer_id=countable_tokenizer(built.config),
        grammar=built.grammar,
        tool_format=built.render_chat.tool_format,
    )


def protocol_version(settings: BackendSettings) -> int:
    return (
        PROTOCOL_VERSION
        if settings.drill_protocol_version is None
        else settings.drill_protocol_version
    )


def announce_faults(service: EngineService, faults: FaultSet, settings: BackendSettings) -> None:
    names = faults.names
    if settings.drill_protocol_version is not None:
        names.append(f"drill_protocol_version={settings.drill_protocol_version}")
    if settings.drill_link_bytes_per_s is not None:
        names.append(f"drill_link_bytes_per_s={settings.drill_link_bytes_per_s:g}")
    for name in names:
        service.metrics.fault_drill.labels(name).set(1)
        log.error(
            "FAULT DRILL ENABLED on the %s role: %s -- this process reproduces a known failure "
            "mode on purpose and must never serve real tenants",
            service.role.value,
            name,
        )
    service.faults = names


def build_unified(settings: BackendSettings) -> RoleRuntime:
    faults = FaultSet.parse(settings.faults, role="unified", allowed=settings.allow_fault_drills)
    built = build_engine(
        settings,
        zero_on_free=faults.zero_on_free(settings.zero_on_free),
        per_tenant_cache=faults.per_tenant_cache_scopes,
    )
    service = make_service(built, settings, Role.UNIFIED)
    announce_faults(service, faults, settings)
    return RoleRuntime(service)


def make_transport(settings: BackendSettings) -> KvTransport:
    bind = settings.transfer_bind_address
    if settings.transport == "inprocess":
        from backend.transport.inprocess import InProcessTransport

        log.warning("in-process KV transport: prefill and decode must share this process")
        return InProcessTransport()
    if settings.transport == "loopback":
        from backend.transport.loopback import LoopbackTransport

        log.info("loopback KV transport on %s (TCP, single host)", bind)
        return LoopbackTransport(host=bind)
    if bind not in WILDCARD_ADDRESSES:
        everywhere = (
            f"the Mooncake transfer engine listens on every interface (0.0.0.0 and ::), not on "
            f"{bind} as KVGUARD_TRANSFER_BIND (or the role's host) asks"
        )
        if settings.mode is RunMode.PRODUCTION:
            raise TransportUnavailable(
                f"{everywhere}: set KVGUARD_TRANSFER_BIND=0.0.0.0 to accept that (every "
                "transfer is sealed), or KVGUARD_TRANSPORT=loopback when both roles share a host"
            )
        log.warning("%s; production refuses this unless KVGUARD_TRANSFER_BIND=0.0.0.0", everywhere)
    from backend.transport.mooncake import MooncakeTransport

    return MooncakeTransport(
        settings.transfer_endpoint_host,
        protocol=settings.transfer_protocol,
        device=settings.transfer_device,
    )


def refuse_open_channel(settings: BackendSettings) -> None:
    """Production never runs the open channel (decode's pools readable and writable by any peer
    of the transfer port)."""
    if settings.kv_channel == "open" and settings.mode is RunMode.PRODUCTION:
        raise ValueError(
            "KVGUARD_KV_CHANNEL=open registers decode's KV pool with the transport unsealed "
            "(every peer of the transfer port reads and writes live KV); production refuses it"
        )


def _register(transport: KvTransport, kv: KVCache) -> None:
    for tensor in (kv.k, kv.v):
        transport.register(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def build_prefill(
    settings: BackendSettings, *, transport: KvTransport | None = None
) -> RoleRuntime:
    faults = FaultSet.parse(settings.faults, role="prefill", allowed=settings.allow_fault_drills)
    zero = faults.zero_on_free(settings.zero_on_free)
    transport = transport or make_transport(settings)  # refusals first, before the model loads
    built = build_engine(
        settings,
        role="prefill",
        zero_on_free=zero,
        per_tenant_cache=faults.per_tenant_cache_scopes,
    )
    service = make_service(built, settings, Role.PREFILL)
    announce_faults(service, faults, settings)
    pages = settings.staging_pages or built.pool.num_pages
    staging = StagingArea(built.model.new_kv_cache(pages, settings.page_size), zero_on_free=zero)
    stager = Stager(built.kv_cache, staging)
    built.engine.core.after_forward = stager
    if settings.kv_channel == "open":  # the unsealed channel sends from registered staging
        _register(transport, staging.kv)
        log.warning("prefill: staging registered with the transport (open channel)")
    prefill = PrefillService(
        engine=built.engine,
        limits=built.limits,
        staging=staging,
        stager=stager,
        transport=transport,
        config=PrefillConfig(
            faults=faults,
            protocol_version=service.protocol_version,
            abort_ack_timeout_s=settings.abort_ack_timeout_s,
            drill_link_bytes_per_s=settings.drill_link_bytes_per_s,
            checksum_algorithm=settings.kv_checksum,
        ),
        metrics=built.metrics,
    )
    return RoleRuntime(service, prefill=prefill, closers=[transport.close])


def build_decode(settings: BackendSettings, *, channel: PrefillLink | None = None) -> RoleRuntime:
    """The decode role; ``channel`` replaces HTTP to prefill (tests with both roles in-process)."""
    if not settings.prefill_url and channel is None:
        raise ValueError("the decode role needs --prefill-url")
    faults = FaultSet.parse(settings.faults, role="decode", allowed=settings.allow_fault_drills)
    transport = make_transport(settings)
    drivers: list[HandoffDriver] = []
    config_box: list[DecodeHandoffConfig] = []
    landings: list[LandingSlots] = []

    def make_core(
        scheduler: Scheduler, runner: ModelRunner, metrics: EngineMetrics
    ) -> DecodeEngineCore:
        assert isinstance(scheduler, DecodeScheduler)
        config = _decode_config(settings, faults, runner.kv_cache)
        config_box.append(config)
        if settings.kv_channel == "sealed":
            slots = LandingSlots(
                layout_of(runner.kv_cache), transport, settings.transfer_batch_pages
            )
            landings.append(slots)

        def notify(notice: Notice) -> None:
            drivers[0].notify_from_engine(notice)

        landing = landings[0] if landings else None
        return DecodeEngineCore(
            scheduler, runner, config, notify=notify, landing=landing, metrics=metrics
        )

    built = build_engine(
        settings,
        role="decode",
        scheduler_cls=DecodeScheduler,
        make_core=make_core,
        zero_on_free=faults.zero_on_free(settings.zero_on_free),
    )
    core = built.engine.core
    assert isinstance(core, DecodeEngineCore)
    service = make_service(built, settings, Role.DECODE)
    announce_faults(service, faults, settings)
    target = _target(transport, built.kv_cache, config_box[0], landings, settings)
    runtime = _decode_runtime(settings, service, core, target, faults, drivers, channel)
    runtime.closers.append(transport.close)
    return runtime


def _target(
    transport: KvTransport,
    kv: KVCache,
    config: DecodeHandoffConfig,
    landings: list[LandingSlots],
    settings: BackendSettings,
) -> TransferTarget:
    """Decode's transfer target: its landing slots (sealed), or its pools, registered now for
    the process's life (open)."""
    bases: tuple[int, ...]
    if landings:
        channel, bases = KvChannel.SEALED, (landings[0].base,)
        memory = f"{kv.num_pages} landing slots of {landings[0].slot_bytes} bytes at {bases[0]:#x}"
    else:
        _register(transport, kv)
        channel, bases = KvChannel.OPEN, (kv.k.data_ptr(), kv.v.data_ptr())
        memory = "the KV pools, registered unsealed (open channel: development only)"
    target = TransferTarget(
        transport.endpoint,
        config.instance_id,
        channel,
        bases,
        layout_of(kv),
        settings.transfer_batch_pages,
    )
    log.info(
        "decode instance %s: transfer endpoint %s, %s channel, %s, batch limit %d pages, "
        "drain bound %.2f s",
        target.instance_id,
        target.endpoint,
        channel.value,
        memory,
        target.max_batch_pages,
        config.drain_s,
    )
    return target


def _decode_config(settings: BackendSettings, faults: FaultSet, kv: KVCache) -> DecodeHandoffConfig:
    layout = layout_of(kv)
    batch_bytes = settings.transfer_batch_pages * 2 * layout.num_layers * layout.page_bytes
    return DecodeHandoffConfig(
        instance_id=uuid.uuid4().hex[:16],
        lease_s=settings.handoff_timeout_s,
        drain_s=drain_bound_s(
            batch_bytes, settings.transfer_min_bytes_per_s, settings.drain_slack_s
        ),
        faults=faults,
        protocol_version=protocol_version(settings),
        keep_read_log=settings.allow_fault_drills,
    )


def _decode_runtime(
    settings: BackendSettings,
    service: EngineService,
    core: DecodeEngineCore,
    target: TransferTarget,
    faults: FaultSet,
    drivers: list[HandoffDriver],
    channel: PrefillLink | None,
) -> RoleRuntime:
    # prefill wants the credential; the hooks put each handoff's HTTP exchange on its span
    client = httpx.AsyncClient(
        headers=settings.engine_headers(),
        event_hooks=HANDOFF_HOOKS,
        limits=httpx.Limits(keepalive_expiry=CLIENT_KEEP_ALIVE_S),  # below prefill's own
    )
    if channel is None:
        assert settings.prefill_url is not None
        channel = HttpPrefillChannel(
            settings.prefill_url, client, local_version=service.protocol_version
        )
    monitor = PrefillMonitor(
        channel,
        announcement=DecodeAnnouncement(service.protocol_version, target),
        own_limits=service.limits,
        local_version=service.protocol_version,
        refresh_s=settings.prefill_capacity_refresh_s,
        stale_s=settings.prefill_capacity_stale_s,
        cross_role_admission=faults.cross_role_admission,
        metrics=service.metrics,
    )
    driver = HandoffDriver(
        engine=service.engine,
        core=core,
        channel=channel,
        target=target,
        abort_timeout_s=settings.abort_ack_timeout_s,
    )
    drivers.append(driver)
    service.guard = monitor
    if core.read_log is not None:
        service.read_log = core.read_log.snapshot
    tasks: list[asyncio.Task[None]] = []

    async def start() -> None:
        for _ in range(20):  # give a prefill that starts alongside us a few seconds
            if await monitor.refresh():
                break
            await asyncio.sleep(0.25)
        tasks.append(asyncio.create_task(monitor.run()))

    async def stop() -> None:
        for task in tasks:
            task.cancel()
        await driver.close()
        await client.aclose()

    return RoleRuntime(service, start=start, stop=stop, handoff=driver)
