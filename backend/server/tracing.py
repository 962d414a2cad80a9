"""OpenTelemetry for the engine: each OpenAI request becomes a span in its caller's trace.

Lifecycle: ``install_tracing`` (in ``create_app``) gives the app its own tracer provider (never the
global one, so several apps can live in one process) and an ASGI middleware. Per request to a
traced path: the caller's ``traceparent`` (the gateway propagates it) is extracted -> a SERVER span
starts as its child -> the response streams -> the span ends with the final body message (so a
streamed answer's span covers the whole stream), or with the error that ended it. Spans are
exported over OTLP/HTTP when ``otlp_endpoint`` is set (the same ``KVGUARD_OTLP_ENDPOINT`` the
gateway reads) or to an exporter a test passes; otherwise nothing is built at all.

Attributes are ids and statuses only (role, request id, tenant id, route, HTTP status), never a
prompt or a completion. Not covered yet: the decode -> prefill handoff call carries no trace
context, so prefill work shows inside decode's span rather than as a span of its own.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from backend.server.schema import REQUEST_ID_HEADER, TENANT_HEADER

TRACED_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Message, Receive, Send], Awaitable[None]]


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


def install_tracing(
    app: FastAPI, *, role: str, otlp_endpoint: str | None, exporter: SpanExporter | None = None
) -> TracerProvider | None:
    """Add the tracing middleware when spans are exported; returns the provider to shut down."""
    provider = tracer_provider(
        f"kvguard-backend-{role}", otlp_endpoint=otlp_endpoint, exporter=exporter
    )
    if provider is not None:
        app.add_middleware(TracingMiddleware, provider=provider, role=role)
    return provider


class TracingMiddleware:
    """A SERVER span per request to ``TRACED_PATHS``, child of the incoming ``traceparent``."""

    def __init__(self, app: ASGIApp, *, provider: TracerProvider, role: str) -> None:
        self.app = app
        self._tracer = provider.get_tracer("kvguard.backend")
        self._role = role
        self._propagator = TraceContextTextMapPropagator()

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in TRACED_PATHS:
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        parent = self._propagator.extract(carrier=headers)
        span = self._tracer.start_span(
            f"engine {scope['path']}", context=parent, kind=SpanKind.SERVER
        )
        span.set_attribute("kvguard.role", self._role)
        span.set_attribute("http.route", scope["path"])
        for header, attribute in (
            (REQUEST_ID_HEADER.lower(), "kvguard.request_id"),
            (TENANT_HEADER.lower(), "kvguard.tenant_id"),
        ):
            if header in headers:
                span.set_attribute(attribute, headers[header][:128])
        ended = False

        async def traced_send(message: Message) -> None:
            nonlocal ended
            if message["type"] == "http.response.start":
                status = int(message["status"])
                span.set_attribute("http.response.status_code", status)
                if status >= 500:
                    span.set_status(Status(StatusCode.ERROR))
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                ended = True
                span.end()

        try:
            with trace.use_span(span, end_on_exit=False):
                await self.app(scope, receive, traced_send)
        except BaseException as exc:
            span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
            raise
        finally:
            if not ended:
                span.end()
