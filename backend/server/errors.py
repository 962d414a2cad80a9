"""OpenAI-style error bodies for the engine's HTTP edge, and the handlers that produce them.

Every failure a client can cause is a 4xx with ``{"error": {"message", "type", "param", "code"}}``
and a stable ``code``; nothing a client sends may produce a 500 or a hang.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from backend.core.errors import KvguardError


def error_body(
    message: str, *, code: str, type_: str = "invalid_request_error", param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


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
    return error_response(exc.http_status, str(exc), code=exc.code, type_=type_)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None
    if first.get("type") == "extra_forbidden":
        return f"unknown field '{param}'", param
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(400, message, code="invalid_request", param=param)

    @app.exception_handler(KvguardError)
    async def _engine(request: Request, exc: KvguardError) -> JSONResponse:
        return engine_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return error_response(exc.status_code, str(exc.detail), code=code)


class BodyGuardMiddleware:
    """Refuses bodies over a size limit (413) and bodies that are not UTF-8 JSON (400).

    Reads the body once, bounded, before the route sees it: a client announcing or streaming more
    than ``max_bytes`` gets a clear 413 without the server buffering the excess.
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
        payload = json.dumps(
            error_body(
                f"{message} (limit {self.max_bytes} bytes)" if status == 413 else message, code=code
            )
        ).encode()
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
