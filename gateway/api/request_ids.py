"""The gateway's request id: one per HTTP request, on every answer, set in one place.

``RequestIds`` wraps the whole app, outside Starlette's error middleware, so every answer carries
the id, whatever produced it: a completion, a 400 from validation, a 401, a 404, the body guard's
413, the 500 of a gateway bug, ``/v1/models``, the admin API. It sends the id twice:
``x-kvguard-request-id`` (audit rows, traces, canary findings, and what the engine is told) and
``x-request-id``, the header OpenAI's SDKs read into an answer's or an exception's ``request_id``.
A route reads the id with ``request_id_of`` (a completion uses it as its audit and trace id).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from contracts.engine import REQUEST_ID_HEADER
from contracts.randomness import RandomBytes

OPENAI_REQUEST_ID = "x-request-id"
_STATE_KEY = "request_id"
_NAMES = (REQUEST_ID_HEADER.lower().encode(), OPENAI_REQUEST_ID.encode())
_RANDOM = RandomBytes()  # the event loop's: an id per request without a system call per request


class RequestIds:
    """ASGI middleware: a fresh id in the request's state, and on its answer's head."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = _RANDOM.take(16).hex()  # 128 random bits, as uuid4's hex without the object
        scope.setdefault("state", {})[_STATE_KEY] = request_id
        ids = id_headers(scope)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message.get("headers", ()) if k.lower() not in _NAMES]
                message["headers"] = [*kept, *ids]
            await send(message)

        await self.app(scope, receive, send_with_id)


def id_headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The id headers of the request ``RequestIds`` gave ``scope`` an id, for an answer written
    below ASGI (``gateway.proxy.reply.DirectReply``); none under an app without it."""
    request_id = scope.get("state", {}).get(_STATE_KEY)
    if request_id is None:
        return []
    value = request_id.encode()
    return [(name, value) for name in _NAMES]


def request_id_of(request: Request) -> str:
    """The id ``RequestIds`` gave this request."""
    request_id: str = request.state.request_id
    return request_id
