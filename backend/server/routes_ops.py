"""Operational routes: health, Prometheus metrics, and the capacity truth."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from backend.server.routes_openai import ServiceDep
from contracts.engine import CapacityReport

router = APIRouter()


@router.get("/health", response_model=None)
async def health(service: ServiceDep) -> dict[str, Any] | JSONResponse:
    """200 while the engine serves; 503 once its loop failed (a supervisor restarts it)."""
    body = {"status": "ok", "role": service.role.value, "model": service.model_name}
    failed = service.engine.failed
    if failed is not None:
        return JSONResponse({**body, "status": "failed", "error": str(failed)}, status_code=503)
    return body


@router.get("/engine/capacity", response_model=CapacityReport)
async def capacity(service: ServiceDep) -> CapacityReport:
    return service.capacity()


@router.get("/metrics")
async def metrics(service: ServiceDep) -> Response:
    return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)
