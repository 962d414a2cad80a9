"""OpenAI-style error bodies for the engine's HTTP edge, and the handlers that produce them.

Every failure a client can cause is a 4xx with ``{"error": {"message", "type", "param", "code"}}``
and a stable ``code``; nothing a client sends may produce a 500 or a hang. An engine bug is a 500
of the same shape (``InternalEngineError``), or that error event in a stream that had started.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend.core.errors import InvalidRequest, KvguardError
from contracts.http_edge import error_body, validation_message

log = logging.getLogger("kvguard.engine")


class InternalEngineError(KvguardError):
    """An engine bug as the client sees it: the usual error shape, a message that names nothing
    internal (the traceback goes to the log only)."""

    code = "internal_error"
    http_status = 500

    def __init__(self) -> None:
        super().__init__("internal engine error")


def error_response(
    status: int,
    message: str,
    *,
    code: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = error_body(message, code=code, type_=type_, param=param)
    return JSONResponse(body, status_code=status, headers=headers)


def engine_error_response(exc: KvguardError) -> JSONResponse:
    type_ = "invalid_request_error" if exc.http_status < 500 else "server_error"
    param = exc.param if isinstance(exc, InvalidRequest) else None
    return error_response(exc.http_status, str(exc), code=exc.code, type_=type_, param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return error_response(400, message, code="invalid_request", param=param)

    @app.exception_handler(KvguardError)
    async def _engine(request: Request, exc: KvguardError) -> JSONResponse:
        return engine_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, str(exc.detail), code=code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # An engine bug: the client still gets the usual error shape (not Starlette's plain-text
        # 500), and the message names nothing internal; the traceback goes to the log only.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return engine_error_response(InternalEngineError())
