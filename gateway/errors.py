"""OpenAI-style errors of the gateway and the handlers that render them.

Every failure has a status, a stable ``code`` and the body
``{"error": {"message", "type", "param", "code"}}``. Anything a client sends (invalid JSON, wrong
types, unknown fields, huge bodies, invalid UTF-8) is a 4xx; a 500 only ever means a gateway bug,
and its message says nothing about internals.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("kvguard.gateway")


def error_body(
    message: str, *, code: str, type_: str = "invalid_request_error", param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class GatewayError(Exception):
    """Base of every error the gateway turns into an HTTP response."""

    status = 500
    code = "internal_error"
    type_ = "server_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}
        if code is not None:
            self.code = code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, code=self.code, type_=self.type_, param=self.param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class InvalidRequest(GatewayError):
    status, code, type_ = 400, "invalid_request", "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class AuthenticationFailed(GatewayError):
    status, code, type_ = 401, "invalid_api_key", "authentication_error"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class PermissionDenied(GatewayError):
    status, code, type_ = 403, "permission_denied", "permission_error"


class NotFound(GatewayError):
    status, code, type_ = 404, "not_found", "invalid_request_error"


class ModelNotFound(NotFound):
    code = "model_not_found"


class Conflict(GatewayError):
    status, code, type_ = 409, "conflict", "invalid_request_error"


class RateLimited(GatewayError):
    status, code, type_ = 429, "rate_limit_exceeded", "rate_limit_error"

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, headers={"Retry-After": str(retry_after_s)})
        self.retry_after_s = retry_after_s


class UpstreamFailed(GatewayError):
    status, code, type_ = 502, "upstream_error", "server_error"


class ServiceUnavailable(GatewayError):
    status, code, type_ = 503, "service_unavailable", "server_error"


class NoHealthyEngine(ServiceUnavailable):
    code = "no_healthy_engine"


class LimiterDown(ServiceUnavailable):
    code = "limiter_unavailable"


class PassThrough(GatewayError):
    """An engine's own OpenAI-style error, relayed with its status (e.g. its 400s)."""

    def __init__(self, status: int, message: str, *, code: str, type_: str, param: str | None):
        super().__init__(message, param=param, code=code)
        self.status = status
        self.type_ = type_


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    kind = first.get("type")
    if kind == "json_invalid":
        return "request body is not valid JSON", None
    if kind == "extra_forbidden":
        return f"unknown field '{param}'", param
    if kind == "missing" and param is None:
        return "request body is required", None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return JSONResponse(error_body(message, code="invalid_request", param=param), 400)

    @app.exception_handler(GatewayError)
    async def _gateway(request: Request, exc: GatewayError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(error_body(str(exc.detail), code=code), exc.status_code)

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        body = error_body("internal gateway error", code="internal_error", type_="server_error")
        return JSONResponse(body, 500)


class BodyGuardMiddleware:
    """Refuses bodies over a size limit (413) and bodies that are not UTF-8 (400), up front.

    Reads the body once, bounded, before any route sees it: a client announcing or streaming more
    than ``max_bytes`` gets a 413 without the gateway buffering the excess.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(send, 413, "request body too large", "body_too_large")
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await self._reject(send, 413, "request body too large", "body_too_large")
                return
        try:
            bytes(body).decode("utf-8")
        except UnicodeDecodeError:
            await self._reject(send, 400, "request body is not valid UTF-8", "invalid_encoding")
            return
        await self.app(scope, _replay(bytes(body), receive), send)

    async def _reject(self, send: Send, status: int, message: str, code: str) -> None:
        if status == 413:
            message = f"{message} (limit {self.max_bytes} bytes)"
        payload = json.dumps(error_body(message, code=code)).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


def _replay(body: bytes, downstream: Receive) -> Receive:
    """Hand the buffered body to the app once, then pass through (so disconnects still arrive)."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await downstream()

    return receive
