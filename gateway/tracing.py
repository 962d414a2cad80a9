"""OpenTelemetry for the gateway: one span per tenant request, its context sent to the engine.

Each app owns its tracer provider (never the global one, so several apps can live in one test
process). Spans are always created and their ``traceparent`` always propagated to the engine, so
the backend's prefill and decode spans join the trace; spans are exported only when an OTLP
endpoint is configured (or a test passes its own exporter). Span attributes are ids, counts and
outcomes, never content.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator


class Tracing:
    def __init__(
        self,
        *,
        service_name: str,
        otlp_endpoint: str | None,
        exporter: SpanExporter | None = None,
    ) -> None:
        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            endpoint = otlp_endpoint.rstrip("/")
            if not endpoint.endswith("/v1/traces"):
                endpoint += "/v1/traces"
            otlp = OTLPSpanExporter(endpoint=endpoint)
            self.provider.add_span_processor(BatchSpanProcessor(otlp))
        if exporter is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("kvguard.gateway")
        self._propagator = TraceContextTextMapPropagator()

    def start_request_span(self, name: str, incoming: Mapping[str, str]) -> Span:
        parent = self._propagator.extract(carrier=dict(incoming))
        return self.tracer.start_span(name, context=parent, kind=SpanKind.SERVER)

    def inject(self, span: Span, headers: dict[str, str]) -> None:
        self._propagator.inject(headers, context=trace.set_span_in_context(span))

    @staticmethod
    def end(span: Span, *, outcome: str, status: int, error_code: str | None) -> None:
        span.set_attribute("kvguard.outcome", outcome)
        span.set_attribute("http.response.status_code", status)
        if error_code is not None:
            span.set_attribute("kvguard.error_code", error_code)
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR, error_code or "error"))
        span.end()

    def shutdown(self) -> None:
        self.provider.shutdown()
