"""The HTTP edge every kvguard server shares: OpenAI-style error bodies and the body guard.

The engine and the gateway render client mistakes the same way — a 4xx with
``{"error": {"message", "type", "param", "code"}}`` and a stable ``code`` — so both import these
pieces instead of keeping copies that could drift.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.types import ASGIApp, Message, Receive, Scope, Send


def error_body(
    message: str, *, code: str, type_: str = "invalid_request_error", param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A one-line message and the offending parameter of a request validation error."""
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


class BodyGuardMiddleware:
    """Refuses bodies over a size limit (413) and bodies that are not UTF-8 (400), up front.

    Reads the body once, bounded, before any route sees it: a client announcing or streaming more
    than ``max_bytes`` gets a 413 without the server buffering the excess.
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
