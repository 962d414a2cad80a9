"""OpenAI-style errors of the gateway and the handlers that render them.

Every failure has a status, a stable ``code`` and the body
``{"error": {"message", "type", "param", "code"}}``. Anything a client sends (invalid JSON, wrong
types, unknown fields, huge bodies, invalid UTF-8) is a 4xx; a 500 only ever means a gateway bug,
and its message says nothing about internals.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError
from sqlalchemy.exc import TimeoutError as PoolTimeout
from starlette.exceptions import HTTPException as StarletteHTTPException

from contracts.http_edge import error_body, validation_message
from contracts.plugins import Cut
from contracts.sql import is_outage

log = logging.getLogger("kvguard.gateway")


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

    def response(self, *, headers: Mapping[str, str] | None = None) -> JSONResponse:
        """The error response, with ``headers`` added to the error's own."""
        merged = {**self.headers, **headers} if headers else self.headers
        return JSONResponse(self.body(), status_code=self.status, headers=merged)


class InvalidRequest(GatewayError):
    status, code, type_ = 400, "invalid_request", "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


def context_length_message(
    *,
    limit: int,
    prompt_tokens: int,
    completion_tokens: int | None,
    prompt_name: str = "messages",
    completion_param: str | None = None,
    reason: str = "",
) -> str:
    """A context-length refusal in OpenAI's own words, which the ecosystem's libraries read:
    litellm maps a message containing "This model's maximum context length is" to its
    ``ContextWindowExceededError`` (``litellm_core_utils/exception_mapping_utils.py``
    ``is_error_str_context_window_exceeded``; it reads the error's text, where the JSON code of
    the body is quoted as Python shows it, so only the words match), and so to its context-window
    fallbacks; LangChain's OpenAI integration raises its ``ContextOverflowError`` when the error's
    text holds ``context_length_exceeded`` (``langchain_openai/chat_models/base.py``
    ``_handle_openai_bad_request``), and the openai SDK 3.x puts only the body's message in that
    text, so the message ends with the code (``CODE_NOTE``). Between the two, the gateway's own
    words: which request parameter set the completion's size (``completion_param``; None: the
    gateway's default) and why the limit is what it is (``reason``, a sentence).

    ``completion_tokens`` None: the prompt alone is over the limit."""
    if completion_tokens is None:
        message = (
            f"This model's maximum context length is {limit} tokens. However, your "
            f"{prompt_name} resulted in {prompt_tokens} tokens. Please reduce the length of the "
            f"{prompt_name}."
        )
    else:
        message = (
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the {prompt_name}, "
            f"{completion_tokens} in the completion). Please reduce the length of the "
            f"{prompt_name} or completion."
        )
        if completion_param is not None:
            message += f" The completion is the request's {completion_param}."
        else:
            message += " The completion is the gateway's default max_tokens (the request set none)."
    if reason:
        message += f" {reason}"
    return f"{message} {CODE_NOTE}"


CODE_NOTE = "(context_length_exceeded)"


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

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: int,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        own = {**(headers or {}), "Retry-After": str(retry_after_s)}
        super().__init__(message, headers=own, code=code)
        self.retry_after_s = retry_after_s


class UpstreamFailed(GatewayError):
    status, code, type_ = 502, "upstream_error", "server_error"


class HandoffMismatch(UpstreamFailed):
    """The engine's handoff proof shows the KV it read may not be this request's."""

    code = "handoff_mismatch"
    MESSAGE = "the engine could not prove this answer's KV belongs to this request"

    def __init__(self) -> None:
        super().__init__(self.MESSAGE)


class Stopped(GatewayError):
    """A response guard stopped the answer (a ``Cut``): its status, code and message.

    Sent with ``x-should-retry: false``, the header OpenAI's SDKs obey before their status rules:
    their automatic retries (two by default, for any 5xx) would send the same request straight
    back to a path the guard's owner has just taken out of service, and the application would
    see only that retry's error (503 ``no_healthy_engine``), never this one."""

    def __init__(self, verdict: Cut) -> None:
        super().__init__(verdict.message, code=verdict.code, headers={"x-should-retry": "false"})
        self.status = verdict.status


class ServiceUnavailable(GatewayError):
    status, code, type_ = 503, "service_unavailable", "server_error"


class NoHealthyEngine(ServiceUnavailable):
    code = "no_healthy_engine"


class LimiterDown(ServiceUnavailable):
    code = "limiter_unavailable"


class DatabaseDown(ServiceUnavailable):
    code = "database_unavailable"


class PassThrough(GatewayError):
    """An engine's own OpenAI-style error, relayed with its status (e.g. its 400s)."""

    def __init__(self, status: int, message: str, *, code: str, type_: str, param: str | None):
        super().__init__(message, param=param, code=code)
        self.status = status
        self.type_ = type_


def served_endpoints(app: FastAPI) -> list[str]:
    """The OpenAI-compatible endpoints this app serves, as ``METHOD /v1/...``: the ``/v1`` paths of
    its OpenAPI document (built once, then cached by FastAPI), where the data plane's routes are
    declared too."""
    paths: dict[str, dict[str, Any]] = app.openapi().get("paths", {})
    served = [
        f"{method.upper()} {path}"
        for path, operations in paths.items()
        if path.startswith("/v1/")
        for method in operations
    ]
    return sorted(served, key=lambda endpoint: (endpoint.split(" ", 1)[1], endpoint))


def unknown_path(method: str, path: str, served: list[str]) -> NotFound:
    """A ``/v1/*`` path no route serves: OpenAI's words for it ("Invalid URL (POST /v1/x)"), and
    the endpoints that are served, so a client on the wrong path learns the right one."""
    shown = path if len(path) <= 256 else f"{path[:256]}..."
    return NotFound(
        f"Invalid URL ({method} {shown}): no such endpoint here. "
        f"This gateway serves {', '.join(served)}.",
        code="unknown_url",
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return JSONResponse(error_body(message, code="invalid_request", param=param), 400)

    @app.exception_handler(GatewayError)
    async def _gateway(request: Request, exc: GatewayError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = request.url.path
        if exc.status_code == 404 and (path == "/v1" or path.startswith("/v1/")):
            return unknown_path(request.method, path, served_endpoints(app)).response()
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(error_body(str(exc.detail), code=code), exc.status_code)

    @app.exception_handler(DBAPIError)
    @app.exception_handler(PoolTimeout)
    @app.exception_handler(psycopg.Error)  # a ``gateway.db.link`` connection's
    async def _database(request: Request, exc: Exception) -> JSONResponse:
        # The database is unreachable (refused, reset, closed, pool exhausted: ``is_outage``):
        # the client's request is fine and may be retried, so a 503 with a stable code, not a
        # 500 "gateway bug". The class name only: the message can hold SQL parameters.
        if not is_outage(exc):
            return await _bug(request, exc)
        name = type(exc).__name__
        log.warning("database unavailable on %s %s: %s", request.method, request.url.path, name)
        return DatabaseDown("The gateway's database is unavailable; retry later.").response()

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        body = error_body("internal gateway error", code="internal_error", type_="server_error")
        return JSONResponse(body, 500)
