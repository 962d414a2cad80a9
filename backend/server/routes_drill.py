"""Drill-only introspection (mounted only with ``allow_fault_drills``).

``GET /engine/drill/kv-reads``: for each recent request whose KV decode accepted, the prompt's
pages with their generations and a short content fingerprint at acceptance and at the end of the
request. Drills and tests use it to show which pages a request really read -- e.g. that with the
incident's faults a request read another request's stale pages. Fingerprints, never content.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from backend.server.routes_openai import ServiceDep

router = APIRouter(prefix="/engine/drill")


@router.get("/kv-reads")
async def kv_reads(service: ServiceDep) -> dict[str, Any]:
    entries = service.read_log() if service.read_log is not None else []
    return {"reads": entries}
