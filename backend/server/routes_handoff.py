"""The prefill role's handoff endpoints: ``POST /kv/v1/prefill`` and ``POST /kv/v1/abort``.

Internal endpoints (decode calls them, with the engine credential; tenants never do). A handoff
whose transfer target is not a known decode peer is refused (403, ``backend.server.auth``) before
anything is computed. A body from another protocol version is
answered 409 with this node's version and a typed error, before anything else in it is read, so
both sides of a mixed-version pair fail closed with a clear message. A body that does not parse
as this version's schema is a 400; the reply to a well-formed request is always 200 with an
explicit outcome (OK, REJECTED, ABORTED or FAILED).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from backend.disagg.errors import MalformedMessage, ProtocolVersionMismatch
from backend.disagg.prefill import PrefillService
from backend.disagg.protocol import (
    abort_request_from_wire,
    check_version,
    prefill_request_from_wire,
    to_wire,
)
from backend.server.auth import TARGET_CODE, target_allowed
from backend.server.errors import error_body
from backend.server.routes_openai import ServiceDep


def get_prefill(request: Request) -> PrefillService:
    prefill: PrefillService = request.app.state.prefill
    return prefill


PrefillDep = Annotated[PrefillService, Depends(get_prefill)]
router = APIRouter(prefix="/kv/v1")
log = logging.getLogger("kvguard.disagg.prefill")


async def _payload(http: Request, version: int, where: str) -> Any:
    try:
        payload = await http.json()
    except ValueError as exc:
        raise MalformedMessage(where, "body is not JSON") from exc
    check_version(payload, where, version)
    return payload


def _refusal(version: int, exc: ProtocolVersionMismatch | MalformedMessage) -> JSONResponse:
    status = 409 if isinstance(exc, ProtocolVersionMismatch) else 400
    body = {
        "protocol_version": version,
        **error_body(str(exc), code=exc.code, type_="server_error"),
    }
    return JSONResponse(body, status_code=status)


@router.post("/prefill")
async def prefill(http: Request, service: ServiceDep, handoff: PrefillDep) -> JSONResponse:
    version = service.protocol_version
    try:
        message = prefill_request_from_wire(
            await _payload(http, version, "prefill request"), version
        )
    except (ProtocolVersionMismatch, MalformedMessage) as exc:
        return _refusal(version, exc)
    if not target_allowed(message.target.endpoint, http.app.state.decode_peers):
        log.error(
            "prefill request %s names transfer target %s, not a known decode peer: refused",
            message.request_id,
            message.target.endpoint,
        )
        problem = "the transfer target is not a decode peer this prefill knows"
        body = {"protocol_version": version, **error_body(problem, code=TARGET_CODE)}
        return JSONResponse(body, status_code=403)
    result = await handoff.handle(message)
    return JSONResponse(to_wire(result))


@router.post("/abort")
async def abort(http: Request, service: ServiceDep, handoff: PrefillDep) -> JSONResponse:
    version = service.protocol_version
    try:
        message = abort_request_from_wire(await _payload(http, version, "abort request"), version)
    except (ProtocolVersionMismatch, MalformedMessage) as exc:
        return _refusal(version, exc)
    return JSONResponse(to_wire(await handoff.abort(message)))
