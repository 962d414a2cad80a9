"""The completion routes below FastAPI: ``/v1/chat/completions``, ``/v1/completions`` and
``POST /v1/responses``.

``CompletionRoutes`` is a raw ASGI app that the gateway's app (``gateway.app.GatewayApp``) calls
for these paths instead of FastAPI's router; per request, in order:

1. ``RequestIds``: an id on every answer (the same middleware as every other route's);
2. ``BodyGuardMiddleware``: the body within its size (413) and time (408) bounds, UTF-8 (400);
3. a method other than POST: 405 ``method_not_allowed``;
4. the tenant's key (``gateway.deps.principal_of``: 401/403; 503 when the database is down);
5. the body read as JSON (orjson; what it refuses, Python's parser), a 400 if it is not;
6. the body validated by the OpenAI schema (``gateway.openai.schemas``), 400 naming the field --
   the same bodies as FastAPI's dependency and validation handlers. Not FastAPI's order, which
   parses the body before any dependency: the key comes first so that a client with no valid
   key costs a cached key lookup, never the parse of up to 8 MiB (0.2-0.9 s of the event loop
   every tenant shares, most of it the garbage collector's on a body of millions of small
   containers); a bad key with a bad body is a 401, not a 400. A body
   orjson parsed is validated within ``contracts.openai.parser_checked_text`` (orjson refuses a
   lone surrogate, so the schema's walk for one is skipped; Python's parser reads one);
7. ``serve_completion`` (``serve_response`` for ``/v1/responses``: ``gateway.proxy.responses``)
   with the reply for the server this runs under (``gateway.proxy.reply``): under the gateway's
   own protocol a stream's chunks go straight to the socket.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import orjson
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.datastructures import Headers
from starlette.types import Receive, Scope, Send

from contracts.http_edge import BodyGuardMiddleware, error_body, validation_message
from contracts.openai import one_request, parser_checked_text
from contracts.sql import DATABASE_ERRORS, is_outage
from gateway.api.request_ids import RequestIds
from gateway.config import GatewaySettings
from gateway.deps import address_of, bearer_of, principal_of
from gateway.errors import DatabaseDown, GatewayError, ServiceUnavailable
from gateway.openai.schemas import ChatCompletionBody, CompletionBody
from gateway.proxy.reply import AsgiReply, reply_for
from gateway.proxy.responses import serve_response
from gateway.proxy.service import serve_completion
from gateway.responses.schemas import CreateResponseBody
from gateway.upstream.base import Endpoint

log = logging.getLogger("kvguard.gateway.proxy")

RequestBody = type[ChatCompletionBody] | type[CompletionBody] | type[CreateResponseBody]
ROUTES: dict[str, tuple[Endpoint, RequestBody]] = {
    Endpoint.CHAT.path: (Endpoint.CHAT, ChatCompletionBody),
    Endpoint.COMPLETIONS.path: (Endpoint.COMPLETIONS, CompletionBody),
    Endpoint.RESPONSES.path: (Endpoint.RESPONSES, CreateResponseBody),
}


class NotJson(Exception):
    """The body is no JSON document."""


class CompletionRoutes:
    def __init__(self, app: Any, *, max_body_bytes: int, body_timeout_s: float) -> None:
        self._app = app  # the FastAPI app: its state holds the gateway once the lifespan ran
        guarded = BodyGuardMiddleware(
            self._serve, max_bytes=max_body_bytes, body_timeout_s=body_timeout_s
        )
        self._asgi = RequestIds(guarded)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._asgi(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        reply = reply_for(scope, receive, send)
        if scope["method"] != "POST":
            refusal = error_body("Method Not Allowed", code="method_not_allowed")
            await reply.json(405, refusal, {"allow": "POST"})
            return
        state = getattr(self._app.state, "gateway", None)
        if state is None:
            await _error(reply, ServiceUnavailable("the gateway is starting; retry shortly"))
            return
        endpoint, model = ROUTES[scope["path"]]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        message = await receive()  # the whole body, read by the guard
        try:
            principal = await principal_of(  # before the parse: no work for the unauthenticated
                state,
                bearer_of(headers.get("authorization")),
                address=lambda: _client(scope, state.settings),
            )
            document, text_checked = _json(message.get("body", b""), headers.get("content-type"))
            if document is None:
                await reply.json(400, _invalid("request body is required", None), {})
                return
            with one_request():  # its passed-on values share one budget
                if text_checked:  # orjson refused any lone surrogate: the schema need not look
                    with parser_checked_text():
                        body = model.model_validate(document)
                else:
                    body = model.model_validate(document)
        except NotJson:
            await reply.json(400, _invalid("request body is not valid JSON", None), {})
            return
        except ValidationError as exc:
            text, param = validation_message(RequestValidationError(_in_body(exc)))
            await reply.json(400, _invalid(text, param), {})
            return
        except GatewayError as err:
            await _error(reply, err)
            return
        except DATABASE_ERRORS as exc:
            if not is_outage(exc):
                raise
            log.warning("database unavailable on POST %s: %s", scope["path"], type(exc).__name__)
            await _error(reply, DatabaseDown("The gateway's database is unavailable; retry later."))
            return
        except Exception:  # a bug: the JSON 500 of FastAPI's routes, never the server's bare one
            log.exception("unhandled error on POST %s", scope["path"])
            await _error(reply, GatewayError("internal gateway error"))
            return
        if isinstance(body, CreateResponseBody):
            await serve_response(
                state.proxy,
                reply=reply,
                principal=principal,
                body=body,
                request_id=scope["state"]["request_id"],
                incoming_headers=headers,
                sessions=state.sessions,
                retention=timedelta(days=state.settings.responses_retention_days),
            )
            return
        await serve_completion(
            state.proxy,
            reply=reply,
            principal=principal,
            body=body,
            endpoint=endpoint,
            request_id=scope["state"]["request_id"],
            incoming_headers=headers,
        )


def _json(raw: bytes, content_type: str | None) -> tuple[Any, bool]:
    """The body as FastAPI reads it: JSON unless a content type says otherwise (then the bytes,
    which the schema refuses); an empty body is a missing one. And whether orjson read it (then
    no string of it holds a lone surrogate: orjson refuses one)."""
    if not raw:
        return None, False
    if content_type and not _is_json(content_type):
        return raw, False
    with _collector_paused():
        try:
            return orjson.loads(raw), True
        except orjson.JSONDecodeError:
            pass
        try:  # what orjson refuses and Python reads (lone surrogates: the schema refuses them)
            return json.loads(raw), False
        except (ValueError, RecursionError) as exc:
            raise NotJson from exc


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """No garbage collection while a body is parsed: a parse makes no reference cycles, and a
    body of millions of small containers started collection after collection, each walking
    what the parse had made so far (an 8 MiB body of empty lists: 1.5 s to parse, 0.19 s with
    the collector paused)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _is_json(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    main, _, sub = kind.partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def _in_body(exc: ValidationError) -> list[dict[str, Any]]:
    """Pydantic's errors located as FastAPI locates a body's (under ``body``)."""
    return [{**error, "loc": ("body", *error.get("loc", ()))} for error in exc.errors()]


def _invalid(message: str, param: str | None) -> dict[str, Any]:
    return error_body(message, code="invalid_request", param=param)


async def _error(reply: AsgiReply, err: GatewayError) -> None:
    await reply.json(err.status, err.body(), err.headers)


def _client(scope: Scope, settings: GatewaySettings) -> str:
    """The client's address for the failed-key throttle (``gateway.deps.client_address``)."""
    client = scope.get("client")
    return address_of(client[0] if client else None, Headers(raw=scope["headers"]), settings)
