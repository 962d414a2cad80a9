"""OpenTelemetry for the engine: each OpenAI request and each KV handoff is a span in its caller's
trace (gateway -> decode -> prefill).

Lifecycle: ``install_tracing`` (in ``create_app``) gives the app its own tracer provider (never the
global one, so several apps can live in one process) and an ASGI middleware. Per request to a
traced path: the caller's ``traceparent`` (the gateway's CLIENT span) is extracted -> a SERVER
span starts as its child -> the response streams -> the span ends with the final body message (so a
streamed answer's span covers the whole stream), or with the error that ended it.

Decode -> prefill: the handoff is sent later, from the event loop's handoff driver, outside the
request's context. The middleware therefore remembers each decode request's span by (request
id, tenant) while it runs (``HandoffTraces``); the driver opens a CLIENT span ``kv handoff`` under
it around the prefill call, and ``HttpPrefillChannel`` puts that span's ``traceparent`` on the
``/kv/v1/prefill`` request, whose SERVER span on prefill is its child. Decode's HTTP client to
prefill carries ``HANDOFF_HOOKS``: while a handoff span is current they record the request it
sends (``server.address``, ``server.port``, ``url.full`` without credentials or query) and the
status it gets; a failure before any status (a refused connection, a timeout) leaves its
exception's type as ``error.type``.

Spans are exported over OTLP/HTTP when ``otlp_endpoint`` is set (the same
``KVGUARD_OTLP_ENDPOINT`` the gateway reads) or to an exporter a test passes; otherwise nothing is
built at all. Attributes follow the HTTP semantic conventions (server spans:
``http.request.method``, ``http.route``, ``http.response.status_code``, ``error.type``; the
handoff's client span: ``http.request.method``, ``server.address``, ``server.port``,
``url.full``, ``http.response.status_code``, ``error.type``) plus ids (role, request id, tenant
id), never a prompt or a completion.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from contracts.engine import REQUEST_ID_HEADER, TENANT_HEADER

TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/kv/v1/prefill"})
MAX_REMEMBERED = 4096  # decode requests in flight whose handoff may still be sent
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Message, Receive, Send], Awaitable[None]]
DEFAULT_PORTS = {"http": 80, "https": 443}


def tracer_provider(
    service_name: str, *, otlp_endpoint: str | None, exporter: SpanExporter | None = None
) -> TracerProvider | None:
    """The app's provider, or None when spans would go nowhere."""
    if not otlp_endpoint and exporter is None:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if otlp_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = otlp_endpoint.rstrip("/")
        if not endpoint.endswith("/v1/traces"):
            endpoint += "/v1/traces"
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


class HandoffTraces:
    """Decode requests' spans by (request id, tenant) while they run, and the handoff's span."""

    def __init__(self, provider: TracerProvider) -> None:
        self._tracer = provider.get_tracer("kvguard.backend")
        self._running: dict[tuple[str, str], SpanContext] = {}

    def remember(self, request_id: str, tenant: str, context: SpanContext) -> None:
        if len(self._running) < MAX_REMEMBERED:
            self._running[(request_id, tenant)] = context

    def forget(self, request_id: str, tenant: str) -> None:
        self._running.pop((request_id, tenant), None)

    @contextmanager
    def handoff(self, request_id: str, tenant: str) -> Iterator[None]:
        """A CLIENT span around one prefill call, current while it runs (so the channel
        propagates it and ``HANDOFF_HOOKS`` record its HTTP exchange); no span when the request's
        own span is unknown."""
        parent = self._running.get((request_id, tenant))
        if parent is None:
            yield
            return
        span = self._tracer.start_span(
            "kv handoff",
            context=trace.set_span_in_context(trace.NonRecordingSpan(parent)),
            kind=SpanKind.CLIENT,
            attributes={"http.request.method": "POST", "kvguard.request_id": request_id[:128]},
        )
        call = _HandoffCall(span)
        token = _CURRENT_HANDOFF.set(call)
        try:
            with trace.use_span(
                span, end_on_exit=True, record_exception=False, set_status_on_exception=False
            ):
                try:
                    yield
                except Exception as exc:  # the span is still open here
                    if not call.answered_error:  # a status >= 400 already names the failure
                        span.set_attribute("error.type", _error_type(exc))
                    span.set_status(Status(StatusCode.ERROR))
                    raise
        finally:
            _CURRENT_HANDOFF.reset(token)


@dataclass(slots=True)
class _HandoffCall:
    """The handoff span the HTTP hooks write to, and whether its answer was an HTTP error."""

    span: Span
    answered_error: bool = False


_CURRENT_HANDOFF: ContextVar[_HandoffCall | None] = ContextVar("kvguard_handoff", default=None)


def _error_type(exc: BaseException) -> str:
    """The exception's fully qualified class name (builtins by their bare name)."""
    kind = type(exc)
    if kind.__module__ == "builtins":
        return kind.__qualname__
    return f"{kind.__module__}.{kind.__qualname__}"


async def _record_request(request: httpx.Request) -> None:
    call = _CURRENT_HANDOFF.get()
    if call is None:
        return
    url = request.url
    if url.userinfo:
        url = url.copy_with(username="REDACTED", password="REDACTED")
    call.span.set_attributes(
        {
            "server.address": url.host,
            "server.port": url.port or DEFAULT_PORTS[url.scheme],
            "url.full": str(url.copy_with(query=None, fragment=None)),
        }
    )


async def _record_response(response: httpx.Response) -> None:
    call = _CURRENT_HANDOFF.get()
    if call is None:
        return
    status = response.status_code
    call.span.set_attribute("http.response.status_code", status)
    if status >= 400:  # a client span's error (OpenTelemetry's HTTP span status rules)
        call.answered_error = True
        call.span.set_attribute("error.type", str(status))
        call.span.set_status(Status(StatusCode.ERROR))


# httpx event hooks for decode's client to prefill; outside a handoff span they do nothing.
HANDOFF_HOOKS: dict[str, list[Callable[..., Any]]] = {
    "request": [_record_request],
    "response": [_record_response],
}


def install_tracing(
    app: FastAPI, *, role: str, otlp_endpoint: str | None, exporter: SpanExporter | None = None
) -> tuple[TracerProvider, HandoffTraces] | None:
    """Add the tracing middleware when spans are exported; returns the provider to shut down
    and the handoff traces decode's driver uses."""
    provider = tracer_provider(
        f"kvguard-backend-{role}", otlp_endpoint=otlp_endpoint, exporter=exporter
    )
    if provider is None:
        return None
    handoffs = HandoffTraces(provider)
    app.add_middleware(TracingMiddleware, provider=provider, role=role, handoffs=handoffs)
    return provider, handoffs


class TracingMiddleware:
    """A SERVER span per request to ``TRACED_PATHS``, child of the incoming ``traceparent``."""

    def __init__(
        self, app: ASGIApp, *, provider: TracerProvider, role: str, handoffs: HandoffTraces
    ) -> None:
        self.app = app
        self._tracer = provider.get_tracer("kvguard.backend")
        self._role = role
        self._handoffs = handoffs
        self._propagator = TraceContextTextMapPropagator()

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in TRACED_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = self._propagator.extract(carrier=headers)
        path = scope["path"]
        span = self._tracer.start_span(
            f"{scope['method']} {path}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": scope["method"],
                "http.route": path,
                "kvguard.role": self._role,
            },
        )
        ids = (headers.get(REQUEST_ID_HEADER.lower()), headers.get(TENANT_HEADER.lower()))
        for value, attribute in zip(ids, ("kvguard.request_id", "kvguard.tenant_id"), strict=True):
            if value is not None:
                span.set_attribute(attribute, value[:128])
        request_id, tenant = ids
        if request_id is not None and tenant is not None:
            self._handoffs.remember(request_id, tenant, span.get_span_context())
        ended = False

        async def traced_send(message: Message) -> None:
            nonlocal ended
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_attribute("error.type", str(status))
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
                span.end()

        try:
            with trace.use_span(span, end_on_exit=False):
                await self.app(scope, receive, traced_send)
        except BaseException as exc:
            span.set_attribute("error.type", type(exc).__name__)
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            if request_id is not None and tenant is not None:
                self._handoffs.forget(request_id, tenant)
            if not ended:
                span.end()
