"""``/health`` (readiness with reasons) and ``/metrics`` (Prometheus text).

``/metrics`` carries per-tenant series (requests, tokens, latency, canary coverage by tenant id),
so it takes the metrics token (``KVGUARD_METRICS_TOKEN``, or the admin token) as a bearer
credential; only a development gateway without one serves it openly. ``/health`` stays public and
names engines and shared services only, never a tenant.

Health answers within ``database_timeout_s`` + 0.5 s whatever the shared services do (a frozen
database or Redis counts as unreachable). It is 503 when the gateway would refuse requests it
should serve: database unreachable,
limiter unreachable (limited tenants fail closed), or no engine routable. Capacity drift does not
stop serving (requests are held to the real pool) but is listed and marks the status degraded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import text
from starlette.responses import Response

from contracts.sql import run_in_session
from gateway.deps import ScraperDep, StateDep
from gateway.state import GatewayState

router = APIRouter(tags=["ops"])


async def _database_ok(state: GatewayState) -> bool:
    try:
        await run_in_session(state.sessions, lambda s: s.execute(text("SELECT 1")))
    except Exception:
        return False
    return True


async def _bounded(check: Awaitable[bool], timeout_s: float) -> bool:
    """A check's answer, or False when it has none within ``timeout_s``: /health always answers."""
    try:
        return await asyncio.wait_for(check, timeout_s)
    except TimeoutError:
        return False


def _engines(state: GatewayState) -> list[dict[str, Any]]:
    out = []
    for record in state.registry.records():
        block = state.registry.block(record)
        snapshot = record.snapshot
        out.append(
            {
                "name": record.name,
                "routable": block is None,
                "blocked_reason": None if block is None else block.value,
                "drift": None if snapshot is None else snapshot.drift,
                "faults": [] if snapshot is None else list(snapshot.faults),
                "max_request_tokens": None if snapshot is None else snapshot.max_request_tokens,
            }
        )
    return out


@router.get("/health")
async def health(state: StateDep) -> JSONResponse:
    bound = state.settings.database_timeout_s + 0.5
    limiter_ok, database_ok = await asyncio.gather(
        _bounded(state.limiter.healthy(), bound), _bounded(_database_ok(state), bound)
    )
    state.metrics.limiter_up.set(1 if limiter_ok else 0)
    engines = _engines(state)
    problems = []
    if not database_ok:
        problems.append("database unreachable")
    if not limiter_ok:
        problems.append(
            "limiter unreachable: limited tenants are refused"
            if not state.settings.limiter_fail_open
            else "limiter unreachable: failing open (limits not enforced)"
        )
    if not any(engine["routable"] for engine in engines):
        problems.append("no routable engine")
    problems += [f"background task {name} ended ({why})" for name, why in state.ended_tasks.items()]
    drift = [engine["name"] for engine in engines if engine["drift"]]
    # failed: a state this replica never leaves (a background task ended), unlike an outage
    status = (
        "failed"
        if state.ended_tasks
        else "unavailable"
        if problems
        else "degraded"
        if drift
        else "ok"
    )
    body = {
        "status": status,
        "problems": problems,
        "limiter": {"backend": state.limiter.backend, "ok": limiter_ok},
        "database": {"ok": database_ok},
        "capacity_drift": drift,
        "engines": engines,
    }
    return JSONResponse(body, status_code=503 if problems else 200)


@router.get("/metrics")
async def metrics(state: StateDep, _: ScraperDep) -> Response:
    state.poller.publish()  # fresh ages and block reasons at scrape time
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
