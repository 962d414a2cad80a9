"""OpenTelemetry for the gateway: a SERVER span per tenant request, a CLIENT span per engine call.

Per request: ``start_request`` opens the SERVER span -> ``start_upstream`` opens its CLIENT child
when the request is forwarded and puts that child's ``traceparent`` on the engine call (the
bundled engine's decode and prefill spans join below it) -> ``end`` closes both with the outcome.

Trust boundary: every request starts a NEW trace. A client's ``traceparent`` is never the parent
and its ``tracestate`` is never kept: either would reach the engine verbatim (what the engine
receives comes from the gateway's own span only). A well-formed client context is recorded as a
span link (trace and span id only) so a tenant's trace can still be found from ours.

Attributes follow OpenTelemetry's semantic conventions: GenAI (``gen_ai.operation.name``,
``gen_ai.request.model``, ``gen_ai.request.max_tokens``, ``gen_ai.provider.name``,
``gen_ai.usage.input_tokens``/``output_tokens``, ``gen_ai.response.finish_reasons``) and HTTP
(``http.request.method``, ``http.route``, ``http.response.status_code``, ``error.type``,
``server.address``/``server.port``, ``url.full``), plus ``kvguard.*`` ids and outcome. Never a
prompt or a completion.

Each app owns its tracer provider (never the global one, so several apps can live in one test
process). Spans are exported when an OTLP endpoint is configured (or a test passes an exporter).
When nothing exports them, the spans are non-recording (attributes, links and ends cost nothing)
but keep real, sampled ids: the engine still gets the gateway's own ``traceparent`` (its spans
join a trace with the gateway's request id on it) and a client's context is still never the
parent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

# The GenAI operation of each OpenAI endpoint the gateway serves (by its path).
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}


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
        self.exporting = bool(otlp_endpoint) or exporter is not None
        self._ids = RandomIdGenerator()

    def _unexported(self, trace_id: int | None = None) -> Span:
        """A span nothing records (nothing would export it), with real ids to propagate."""
        context = SpanContext(
            trace_id=trace_id if trace_id is not None else self._ids.generate_trace_id(),
            span_id=self._ids.generate_span_id(),
            is_remote=False,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
        )
        return NonRecordingSpan(context)

    def start_request(self, route: str, model: str, incoming: Mapping[str, str]) -> Span:
        """The SERVER span of a tenant request to ``route``: a new trace, linked to the
        client's (if it sent a valid ``traceparent``)."""
        if not self.exporting:
            return self._unexported()
        operation = OPERATIONS.get(route, route)
        attributes = {
            "http.request.method": "POST",
            "http.route": route,
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": model[:256],
        }
        return self.tracer.start_span(
            f"POST {route}",
            context=trace.set_span_in_context(trace.INVALID_SPAN),  # a new root, always
            kind=SpanKind.SERVER,
            attributes=attributes,
            links=self._client_link(incoming),
        )

    def _client_link(self, incoming: Mapping[str, str]) -> Sequence[Link]:
        carrier = {k.lower(): v for k, v in incoming.items() if k.lower() == "traceparent"}
        theirs = trace.get_current_span(self._propagator.extract(carrier=carrier))
        context = theirs.get_span_context()
        if not context.is_valid:
            return []
        # Ids only: the client's tracestate (free text of its vendors) is dropped.
        bare = SpanContext(context.trace_id, context.span_id, is_remote=True)
        return [Link(bare, {"kvguard.link": "client_traceparent"})]

    def start_upstream(
        self,
        request_span: Span,
        *,
        base_url: str,
        route: str,
        provider: str,
        model: str,
        max_tokens: int,
        headers: dict[str, str],
    ) -> Span:
        """The CLIENT span of the engine call (child of ``request_span``); its ``traceparent``
        goes into ``headers``, the only trace context the engine receives."""
        if not request_span.is_recording():
            child = self._unexported(request_span.get_span_context().trace_id)
            headers.pop("tracestate", None)
            headers["traceparent"] = _traceparent(child.get_span_context())
            return child
        url = urlsplit(base_url.rstrip("/") + route)
        operation = OPERATIONS.get(route, route)
        attributes: dict[str, str | int] = {
            "gen_ai.operation.name": operation,
            "gen_ai.provider.name": provider,
            "gen_ai.request.model": model[:256],
            "gen_ai.request.max_tokens": max_tokens,
            "http.request.method": "POST",
            "server.address": url.hostname or "",
            "url.full": url.geturl(),
        }
        if url.port is not None:
            attributes["server.port"] = url.port
        span = self.tracer.start_span(
            f"{operation} {model[:256]}",
            context=trace.set_span_in_context(request_span),
            kind=SpanKind.CLIENT,
            attributes=attributes,
        )
        headers.pop("tracestate", None)
        self._propagator.inject(headers, context=trace.set_span_in_context(span))
        return span

    @staticmethod
    def end(
        span: Span,
        upstream: Span | None,
        *,
        outcome: str,
        status: int,
        error_code: str | None,
        usage: tuple[int | None, int | None] = (None, None),
        finish_reasons: Sequence[str] = (),
    ) -> None:
        """Close the engine call's span (if any), then the request's, with the usage (input,
        output tokens), finish reasons and the outcome."""
        if not span.is_recording():
            return
        answered = {
            "gen_ai.usage.input_tokens": usage[0],
            "gen_ai.usage.output_tokens": usage[1],
            "gen_ai.response.finish_reasons": tuple(finish_reasons) or None,
        }
        for target in (upstream, span):
            if target is None:
                continue
            for key, value in answered.items():
                if value is not None:
                    target.set_attribute(key, value)
            if error_code is not None and status >= 500:
                target.set_attribute("error.type", error_code)
                target.set_status(Status(StatusCode.ERROR, error_code))
        span.set_attribute("kvguard.outcome", outcome)
        span.set_attribute("http.response.status_code", status)
        if error_code is not None:
            span.set_attribute("kvguard.error_code", error_code)
        if upstream is not None:
            upstream.end()
        span.end()

    def shutdown(self) -> None:
        self.provider.shutdown()


def _traceparent(context: SpanContext) -> str:
    """The W3C ``traceparent`` of ``context``, as ``TraceContextTextMapPropagator.inject`` writes
    it (opentelemetry-api 1.45, ``trace/propagation/tracecontext.py``) without building a
    ``Context`` per request; an unexported span has no tracestate to add."""
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
