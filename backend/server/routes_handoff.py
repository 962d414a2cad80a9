"""The prefill role's handoff endpoints: ``POST /kv/v1/decode``, ``/prefill`` and ``/abort``.

Internal endpoints (decode calls them, with the engine credential; tenants never do). A decode
announces its exact transfer target at ``/kv/v1/decode``; a handoff whose target is not exactly an
announced one is refused (403, ``backend.server.auth.DecodePeers``) before anything is computed. A
body from another protocol version is answered 409 with this node's version and a typed error,
before anything else in it is read, so both sides of a mixed-version pair fail closed with a clear
message. A body that does not parse as this version's schema is a 400; the reply to a well-formed
request is always 200 with an explicit outcome (OK, REJECTED, ABORTED or FAILED).
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
    decode_announcement_from_wire,
    prefill_request_from_wire,
    to_wire,
)
from backend.server.auth import TARGET_CODE, DecodePeers
from backend.server.errors import error_body
from backend.server.routes_openai import ServiceDep


def get_prefill(request: Request) -> PrefillService:
    prefill: PrefillService = request.app.state.prefill
    return prefill


def get_peers(request: Request) -> DecodePeers:
    peers: DecodePeers = request.app.state.decode_peers
    return peers


PrefillDep = Annotated[PrefillService, Depends(get_prefill)]
PeersDep = Annotated[DecodePeers, Depends(get_peers)]
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


def _forbidden(version: int, problem: str) -> JSONResponse:
    body = {"protocol_version": version, **error_body(problem, code=TARGET_CODE)}
    return JSONResponse(body, status_code=403)


@router.post("/decode")
async def announce(http: Request, service: ServiceDep, peers: PeersDep) -> JSONResponse:
    version = service.protocol_version
    try:
        message = decode_announcement_from_wire(
            await _payload(http, version, "decode announcement"), version
        )
    except (ProtocolVersionMismatch, MalformedMessage) as exc:
        return _refusal(version, exc)
    problem = peers.announce(message.target)
    if problem is not None:
        log.error("decode announcement of %s refused: %s", message.target.endpoint, problem)
        return _forbidden(version, problem)
    return JSONResponse(to_wire(message))


@router.post("/prefill")
async def prefill(
    http: Request, service: ServiceDep, handoff: PrefillDep, peers: PeersDep
) -> JSONResponse:
    version = service.protocol_version
    try:
        message = prefill_request_from_wire(
            await _payload(http, version, "prefill request"), version
        )
    except (ProtocolVersionMismatch, MalformedMessage) as exc:
        return _refusal(version, exc)
    if not peers.allows(message.target):
        log.error(
            "prefill request %s names transfer target %s (instance %s), not one a decode peer "
            "announced: refused",
            message.request_id,
            message.target.endpoint,
            message.target.instance_id,
        )
        return _forbidden(version, "the transfer target is not one a decode peer announced")
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
