"""The tenant request path end to end, owned by one ``Flight``: admit -> forward -> relay -> finish.

``serve_completion`` returns a ``FlightResponse``; sending it runs the request's whole life in
``Flight.run``, inside one ``try/finally``:

1. admit (``gateway.proxy.admission``): route, count, fit, take the tenant's concurrency lease;
2. forward: take the engine's in-flight slot and call the engine -- for a whole answer
   (``_answer``), or for a stream relayed event by event as it arrives (``_stream``);
3. whatever happens becomes one ``Outcome`` (``gateway.proxy.ending``): an answer delivered, a
   refusal raised by any phase (a ``GatewayError``), a response guard's cut, a bug (logged; a 500,
   or an error event once a stream is open), or the client going away -- a watcher reads
   ``http.disconnect`` and cancels the flight, whether it waits for the engine or streams;
4. the ``finally`` applies the ending (``gateway.proxy.finish``: the lease released with its
   refund, the in-flight slot freed, the audit row, metrics, span, ``on_finish``), shielded from
   cancellation so it runs however the flight ends; only then is the rest of the reply sent, so
   a client that has read its whole answer finds it audited.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import anyio
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from contracts.engine import REQUEST_ID_HEADER, TENANT_HEADER, HandoffProof, handoff_of
from contracts.plugins import ENGINE_HEADER, Cut, StreamGuard
from contracts.sse import SseSplitter
from gateway.domain import Principal
from gateway.errors import (
    GatewayError,
    HandoffMismatch,
    NoHealthyEngine,
    PassThrough,
    Stopped,
    UpstreamFailed,
)
from gateway.lifecycle import Phase
from gateway.proxy import latency
from gateway.proxy.admission import Admitted, Body, admit
from gateway.proxy.context import RequestContext
from gateway.proxy.deps import ProxyDeps
from gateway.proxy.ending import (
    CLIENT_GONE,
    COMPLETED,
    INTERNAL,
    Outcome,
    cut,
    refused,
    stream_ended,
)
from gateway.proxy.finish import finish
from gateway.proxy.relay import (
    MAX_CHOICES,
    InvalidUpstream,
    StreamRelay,
    error_event,
    own_usage,
    relay_body,
    screen,
)
from gateway.upstream.base import (
    Endpoint,
    UpstreamCall,
    UpstreamReply,
    UpstreamStream,
    UpstreamUnreachable,
)

log = logging.getLogger("kvguard.gateway.proxy")


async def serve_completion(
    deps: ProxyDeps,
    *,
    principal: Principal,
    body: Body,
    endpoint: Endpoint,
    request_id: str,
    incoming_headers: Mapping[str, str],
) -> Response:
    span = deps.tracing.start_request(endpoint.path, body.model, incoming_headers)
    span.set_attribute("kvguard.tenant_id", principal.tenant_id)
    span.set_attribute("kvguard.request_id", request_id)
    ctx = RequestContext(
        request_id=request_id,
        principal=principal,
        endpoint=endpoint,
        model=body.model,
        stream=body.stream,
        span=span,
    )
    return FlightResponse(Flight(deps, ctx, body))


class FlightResponse(Response):
    """The response of a tenant request: sending it runs the request (``Flight.run``)."""

    def __init__(self, flight: Flight) -> None:
        super().__init__()
        self.flight = flight

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.flight.run(scope, receive, send)


class ClientGone(Exception):
    """Sending to the client failed: it went away."""


class Flight:
    """One tenant request's context, lease and in-flight slot, from admission to the end."""

    def __init__(self, deps: ProxyDeps, ctx: RequestContext, body: Body) -> None:
        self.deps = deps
        self.ctx = ctx
        self.body = body
        self._send: Send | None = None
        self._streaming = False  # the stream's head went out: errors become error events

    async def run(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._send = send
        outcome = Outcome(CLIENT_GONE)  # what a cancelled flight leaves
        try:
            outcome = await self._watched(receive)
        finally:
            await finish(self.deps, self.ctx, outcome.ending)
        reply = outcome.reply
        if isinstance(reply, Response):
            await reply(scope, receive, send)
        elif reply is not None:
            await send({"type": "http.response.body", "body": reply, "more_body": False})

    async def _watched(self, receive: Receive) -> Outcome:
        """The outcome, or ``CLIENT_GONE`` when the client disconnects first.

        A plain task watches (an anyio task group costs about 130 us more per request here);
        cancelling the scope still honours the shielded parts (``on_cut``, closing the stream).
        """
        with anyio.CancelScope() as scope:
            watcher = asyncio.create_task(_cancel_on_disconnect(receive, scope))
            try:
                return await self._outcome()
            finally:
                watcher.cancel()
        return Outcome(CLIENT_GONE)

    async def _outcome(self) -> Outcome:
        """Every way this request can end, as a value (cancellation propagates)."""
        try:
            return await self._serve()
        except GatewayError as err:
            return Outcome(refused(err, engine_answered=self.ctx.answered), self._error(err))
        except ClientGone:
            return Outcome(CLIENT_GONE)
        except Exception:
            log.exception("request %s failed inside the gateway", self.ctx.request_id)
            return Outcome(INTERNAL, self._error(GatewayError("internal gateway error")))

    async def _serve(self) -> Outcome:
        admitted = await admit(self.deps, self.ctx, self.body)
        call = self._forward(admitted)
        if self.body.stream:
            return await self._stream(call, wants_usage=self.body.wants_usage_chunk())
        return await self._answer(call)

    def _forward(self, admitted: Admitted) -> UpstreamCall:
        ctx, deps = self.ctx, self.deps
        ctx.engine = admitted.engine
        ctx.engine.in_flight += 1
        deps.metrics.in_flight.labels(tenant=ctx.principal.tenant_id).inc()
        ctx.advance(Phase.FORWARDED)
        ctx.forwarded_s = ctx.elapsed_s()
        deps.metrics.overhead_seconds.labels(endpoint=ctx.endpoint.value).observe(ctx.forwarded_s)
        ctx.span.set_attribute("kvguard.engine", admitted.engine.name)
        ctx.span.set_attribute("kvguard.prompt_tokens", admitted.size.prompt_tokens)
        ctx.span.set_attribute("gen_ai.request.max_tokens", admitted.size.max_tokens)
        headers = {TENANT_HEADER: ctx.principal.tenant_id, REQUEST_ID_HEADER: ctx.request_id}
        spec = admitted.engine.spec
        ctx.upstream_span = deps.tracing.start_upstream(
            ctx.span,
            base_url=spec.base_url,
            route=ctx.endpoint.path,
            provider=spec.kind.value,
            model=str(admitted.body.get("model") or ctx.model),
            max_tokens=admitted.size.max_tokens,
            headers=headers,
        )
        return UpstreamCall(
            spec=admitted.engine.spec, endpoint=ctx.endpoint, body=admitted.body, headers=headers
        )

    # -- replies ---------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        # the request id headers are every answer's (gateway.api.request_ids)
        if self.ctx.principal.synthetic and self.ctx.engine is not None:
            return {ENGINE_HEADER: self.ctx.engine.name}  # canary probes report per engine
        return {}

    def _error(self, err: GatewayError) -> Response | bytes:
        """The error as a response, or as the last event of a stream already open."""
        if self._streaming:
            return error_event(err.message, err.code, err.type_)
        return err.response(headers=self._headers())

    async def _emit_ready(self, ready: list[bytes]) -> None:
        if not ready:
            return
        if self.ctx.first_byte_s is None:
            self.ctx.first_byte_s = self.ctx.elapsed_s()
        await self._emit(ready[0] if len(ready) == 1 else b"".join(ready))

    async def _emit(self, data: bytes) -> None:
        assert self._send is not None
        try:
            await self._send({"type": "http.response.body", "body": data, "more_body": True})
        except OSError as exc:  # an ASGI server that raises once the client is gone
            raise ClientGone from exc

    # -- a whole answer --------------------------------------------------------------------------

    async def _answer(self, call: UpstreamCall) -> Outcome:
        reply = await self._call_engine(call)
        if reply.status != 200:
            return await self._engine_refused(reply)
        if reply.body is None:
            raise UpstreamFailed("invalid engine answer")
        ctx, body = self.ctx, reply.body
        ctx.answered = True
        usage = body.get("usage")
        if isinstance(usage, dict):
            ctx.completion_tokens = _count(usage.get("completion_tokens"))
            ctx.engine_prompt_tokens = _count(usage.get("prompt_tokens"))
        ctx.finish_reasons = _finish_reasons(body)
        self._check_handoff(handoff_of(body))
        capabilities = self.deps.hooks.guards.capabilities
        try:
            result = relay_body(
                ctx.endpoint,
                body,
                self._open_guard,
                screen_side=capabilities.screens_side,
                side_prefilter=capabilities.side_prefilter,
                raw=reply.raw,
            )
        except InvalidUpstream as exc:
            raise UpstreamFailed("the engine sent an invalid answer") from exc
        if isinstance(result, Cut):
            return await self._cut(result)
        if ctx.hidden_prompt_tokens and isinstance(result.get("usage"), dict):
            result = own_usage(result, ctx.hidden_prompt_tokens)  # the tenant's own usage
        ctx.first_byte_s = ctx.elapsed_s()
        latency.answered(self.deps, ctx)
        return Outcome(COMPLETED, JSONResponse(result, headers=self._headers()))

    async def _call_engine(self, call: UpstreamCall) -> UpstreamReply:
        try:
            return await self.deps.upstream_for(call.spec).complete(call)
        except UpstreamUnreachable as exc:
            log.warning("engine %s unreachable: %s", call.spec.name, exc)
            raise UpstreamFailed("the engine could not be reached") from exc

    async def _engine_refused(self, reply: UpstreamReply) -> Outcome:
        """An engine's non-200 answer: its own 4xx passes through (screened), else a 502/503."""
        error = (reply.body or {}).get("error")
        if 400 <= reply.status < 500 and reply.status != 429 and isinstance(error, dict):
            screened = screen(self._open_guard(), _engine_message(error))
            if isinstance(screened, Cut):
                return await self._cut(screened)
            raw_code, param = error.get("code"), error.get("param")
            raise PassThrough(
                reply.status,
                screened,
                code=raw_code if isinstance(raw_code, str) else "upstream_rejected",
                type_=str(error.get("type") or "invalid_request_error"),
                param=param if isinstance(param, str) else None,
            )
        if reply.status in (429, 503):
            raise NoHealthyEngine("the engine is overloaded; retry later", code="engine_overloaded")
        raise UpstreamFailed(f"the engine answered HTTP {reply.status}")

    def _check_handoff(self, proof: HandoffProof | None) -> None:
        if not note_handoff(self.deps, self.ctx, proof):
            raise HandoffMismatch()

    def _open_guard(self) -> StreamGuard:
        return self.deps.hooks.guards.open(self.ctx.info())

    async def _cut(self, verdict: Cut) -> Outcome:
        await self._report_cut(verdict)
        return Outcome(cut(verdict), self._error(Stopped(verdict)))

    async def _report_cut(self, verdict: Cut) -> None:
        on_cut = self.deps.hooks.on_cut
        if on_cut is not None:
            with anyio.CancelScope(shield=True):
                try:
                    await on_cut(self.ctx.info(), verdict)
                except Exception:
                    log.exception("on_cut hook failed for request %s", self.ctx.request_id)

    # -- a stream --------------------------------------------------------------------------------

    async def _stream(self, call: UpstreamCall, *, wants_usage: bool) -> Outcome:
        try:
            opened = await self.deps.upstream_for(call.spec).stream(call)
        except UpstreamUnreachable as exc:
            log.warning("engine %s unreachable: %s", call.spec.name, exc)
            raise UpstreamFailed("the engine could not be reached") from exc
        if isinstance(opened, UpstreamReply):
            return await self._engine_refused(opened)
        self.ctx.answered = True
        try:
            self.ctx.advance(Phase.STREAMING)
            capabilities = self.deps.hooks.guards.capabilities
            relay = StreamRelay(
                endpoint=self.ctx.endpoint,
                open_guard=self._open_guard,
                wants_usage=wants_usage,
                refuse_handoff_mismatch=self.deps.settings.refuse_on_handoff_mismatch,
                screen_side=capabilities.screens_side,
                side_prefilter=capabilities.side_prefilter,
                hidden_prompt_tokens=self.ctx.hidden_prompt_tokens,
            )
            await self._start_stream()
            return await self._relay(opened, relay)
        finally:
            with anyio.CancelScope(shield=True):
                await opened.aclose()

    async def _start_stream(self) -> None:
        assert self._send is not None
        headers = {**self._headers(), "cache-control": "no-cache"}
        raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        raw.append((b"content-type", b"text/event-stream; charset=utf-8"))
        self._streaming = True
        try:
            await self._send({"type": "http.response.start", "status": 200, "headers": raw})
        except OSError as exc:
            raise ClientGone from exc

    async def _relay(self, opened: UpstreamStream, relay: StreamRelay) -> Outcome:
        """Each upstream read's events through the relay; what they give the client goes out in
        one write per read (the bytes an upstream read brings are all there at once: joining them
        delays none, and a busy gateway, whose reads carry several events, writes less often)."""
        ctx, splitter = self.ctx, SseSplitter()
        try:
            async for chunk in opened.chunks():
                ready: list[bytes] = []
                for raw in splitter.feed(chunk):
                    step = relay.on_event(raw)
                    latency.tick(self.deps, ctx, relay.text_events)
                    if relay.saw_text and ctx.first_token_s is None:
                        ctx.first_token_s = ctx.elapsed_s() - (ctx.forwarded_s or 0.0)
                    ready += step.out
                    if step.end is not None:
                        await self._emit_ready(ready)
                        return await self._stream_ended(relay, step.end, step.code, b"")
                await self._emit_ready(ready)
            step = relay.on_upstream_end()
        except UpstreamUnreachable:
            step = relay.on_upstream_end()
        return await self._stream_ended(relay, step.end or Phase.FAILED, step.code, *step.out)

    async def _stream_ended(
        self, relay: StreamRelay, end: Phase, code: str | None, *last: bytes
    ) -> Outcome:
        self.ctx.completion_tokens = relay.completion_tokens
        self.ctx.engine_prompt_tokens = relay.prompt_tokens
        self.ctx.finish_reasons = tuple(relay.finish_reasons)
        note_handoff(self.deps, self.ctx, relay.handoff)
        if end is Phase.CUT and relay.cut is not None:
            await self._report_cut(relay.cut)
        return Outcome(stream_ended(end, code, relay.cut), b"".join(last))


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    """Cancel the flight when the client disconnects (its body has been read by then)."""
    try:
        while (await receive())["type"] != "http.disconnect":
            pass
    except Exception:  # the server cannot tell us: stop watching, the flight goes on
        log.exception("watching for the client's disconnect failed")
        return
    scope.cancel()


def note_handoff(deps: ProxyDeps, ctx: RequestContext, proof: HandoffProof | None) -> bool:
    """Record the engine's handoff proof; False when it shows a mismatch and the gateway refuses
    such answers (``refuse_on_handoff_mismatch``, on by default: never trust that KV)."""
    if proof is None:
        return True
    ctx.handoff = proof
    if proof.consistent:
        return True
    engine = ctx.engine.name if ctx.engine is not None else "unknown"
    deps.metrics.handoff_mismatch.labels(engine=engine).inc()
    log.error(
        "handoff mismatch on engine %s for request %s: outcome=%s reserved=%s transferred=%s",
        engine,
        ctx.request_id,
        proof.outcome,
        proof.reserved_tokens,
        proof.transferred_tokens,
    )
    return not deps.settings.refuse_on_handoff_mismatch


def _engine_message(error: dict[str, Any]) -> str:
    return str(error.get("message") or "the engine refused the request")[:2000]


def _finish_reasons(body: dict[str, Any]) -> tuple[str, ...]:
    """Each choice's ``finish_reason`` in a whole (non-streamed) answer, for the span."""
    choices = body.get("choices")
    if not isinstance(choices, list):
        return ()
    reasons = (c.get("finish_reason") for c in choices[:MAX_CHOICES] if isinstance(c, dict))
    return tuple(r[:64] for r in reasons if isinstance(r, str))


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
