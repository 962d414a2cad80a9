"""The tenant request path end to end: admit -> forward -> relay -> finish.

``finish`` is the one place a request ends: it moves the context to its terminal phase (once;
later calls are no-ops), releases the concurrency lease and refunds unused tokens, frees the
engine's in-flight slot, records the audit row (metadata only), metrics and the span. It runs
shielded from cancellation, so a client that disconnects mid-stream still releases everything.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

import anyio
from fastapi.responses import JSONResponse
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from backend.server.schema import REQUEST_ID_HEADER, TENANT_HEADER
from gateway.domain import Principal
from gateway.errors import GatewayError, NoHealthyEngine, PassThrough, UpstreamFailed
from gateway.hooks import ENGINE_HEADER, Cut, PassThroughFactory, StreamGuard
from gateway.lifecycle import TERMINAL, Phase
from gateway.proxy import latency
from gateway.proxy.admission import Admitted, Body, admit
from gateway.proxy.context import RequestContext, parse_handoff
from gateway.proxy.finish import finish, handoff_refused, note_handoff
from gateway.proxy.relay import (
    MAX_CHOICES,
    InvalidUpstream,
    OpenGuard,
    StreamRelay,
    relay_body,
    screen,
)
from gateway.proxy.side import Prefilter
from gateway.state import GatewayState
from gateway.upstream.base import Endpoint, UpstreamCall, UpstreamReply, UpstreamUnreachable
from gateway.upstream.sse import SseSplitter

log = logging.getLogger("kvguard.gateway.proxy")


async def serve_completion(
    state: GatewayState,
    *,
    principal: Principal,
    body: Body,
    endpoint: Endpoint,
    incoming_headers: Mapping[str, str],
) -> Response:
    request_id = uuid.uuid4().hex
    span = state.tracing.start_request(endpoint.path, body.model, incoming_headers)
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
    try:
        admitted = await admit(state, ctx, body)
    except GatewayError as exc:
        await finish(state, ctx, _ending(exc.status), status=exc.status, code=exc.code)
        exc.headers[REQUEST_ID_HEADER] = request_id
        raise
    except BaseException:
        await finish(state, ctx, Phase.FAILED, status=500, code="internal_error")
        raise
    call = _forward(state, ctx, admitted)
    if body.stream:
        return await _open_stream(state, ctx, call, wants_usage=body.wants_usage_chunk())
    return await _complete(state, ctx, call)


def _ending(status: int) -> Phase:
    return Phase.REJECTED if status < 500 else Phase.FAILED


def _forward(state: GatewayState, ctx: RequestContext, admitted: Admitted) -> UpstreamCall:
    ctx.engine = admitted.engine
    ctx.engine.in_flight += 1
    state.metrics.in_flight.labels(tenant=ctx.principal.tenant_id).inc()
    ctx.advance(Phase.FORWARDED)
    ctx.forwarded_s = ctx.elapsed_s()
    state.metrics.overhead_seconds.labels(endpoint=ctx.endpoint.value).observe(ctx.forwarded_s)
    ctx.span.set_attribute("kvguard.engine", admitted.engine.name)
    ctx.span.set_attribute("kvguard.prompt_tokens", admitted.size.prompt_tokens)
    ctx.span.set_attribute("gen_ai.request.max_tokens", admitted.size.max_tokens)
    headers = {TENANT_HEADER: ctx.principal.tenant_id, REQUEST_ID_HEADER: ctx.request_id}
    spec = admitted.engine.spec
    ctx.upstream_span = state.tracing.start_upstream(
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


def _reply_error(reply: UpstreamReply) -> GatewayError:
    """An engine's non-200 answer: its own 4xx passes through; anything else is a 502/503."""
    error = (reply.body or {}).get("error")
    if 400 <= reply.status < 500 and reply.status != 429 and isinstance(error, dict):
        raw_code = error.get("code")
        code = raw_code if isinstance(raw_code, str) else "upstream_rejected"
        message = str(error.get("message") or "the engine refused the request")[:2000]
        type_ = str(error.get("type") or "invalid_request_error")
        param = error.get("param") if isinstance(error.get("param"), str) else None
        return PassThrough(reply.status, message, code=code, type_=type_, param=param)
    if reply.status in (429, 503):
        return NoHealthyEngine("the engine is overloaded; retry later", code="engine_overloaded")
    return UpstreamFailed(f"the engine answered HTTP {reply.status}")


async def _complete(state: GatewayState, ctx: RequestContext, call: UpstreamCall) -> Response:
    headers = _reply_headers(ctx)
    try:
        reply = await state.upstream_for(call.spec).complete(call)
    except UpstreamUnreachable as exc:
        log.warning("engine %s unreachable: %s", call.spec.name, exc)
        err: GatewayError = UpstreamFailed("the engine could not be reached")
        await finish(state, ctx, Phase.FAILED, status=502, code=err.code, refund_all=True)
        raise _with_headers(err, headers) from exc
    if reply.status != 200 or reply.body is None:
        if reply.status == 200:
            err = UpstreamFailed("invalid engine answer")
            await finish(state, ctx, Phase.FAILED, status=502, code=err.code, refund_all=True)
            raise _with_headers(err, headers)
        raise await _refused_reply(state, ctx, reply, headers)
    return await _deliver_body(state, ctx, reply.body, headers, raw=reply.raw)


def _reply_headers(ctx: RequestContext) -> dict[str, str]:
    headers = {REQUEST_ID_HEADER: ctx.request_id}
    if ctx.principal.synthetic and ctx.engine is not None:
        headers[ENGINE_HEADER] = ctx.engine.name  # canary probes report results per engine
    return headers


def _screens_side(state: GatewayState) -> bool:
    """Side fields need screening only when the guards can find something (the canary is on)."""
    return not isinstance(state.hooks.guards, PassThroughFactory)


def _side_prefilter(state: GatewayState) -> Prefilter | None:
    """The guards' cheap test that an answer's side fields cannot hold what they look for."""
    prefilter: Prefilter | None = getattr(state.hooks.guards, "side_prefilter", None)
    return prefilter


def _open_guard(state: GatewayState, ctx: RequestContext) -> OpenGuard:
    def open_guard() -> StreamGuard:
        return state.hooks.guards.open(ctx.info())

    return open_guard


async def _refused_reply(
    state: GatewayState, ctx: RequestContext, reply: UpstreamReply, headers: dict[str, str]
) -> GatewayError:
    """The error for an engine's non-200 answer; the engine's own message is screened too."""
    err = _reply_error(reply)
    if isinstance(err, PassThrough):
        screened = screen(_open_guard(state, ctx)(), err.message)
        if isinstance(screened, Cut):
            return await _cut_error(state, ctx, screened, headers)
        err.message, err.args = screened, (screened,)
    await finish(state, ctx, _ending(err.status), status=err.status, code=err.code, refund_all=True)
    return _with_headers(err, headers)


async def _cut_error(
    state: GatewayState, ctx: RequestContext, cut: Cut, headers: dict[str, str]
) -> GatewayError:
    await _report_cut(state, ctx, cut)
    await finish(state, ctx, Phase.CUT, status=cut.status, code=cut.code)
    err = GatewayError(cut.message, code=cut.code)
    err.status = cut.status
    return _with_headers(err, headers)


async def _deliver_body(
    state: GatewayState,
    ctx: RequestContext,
    body: dict[str, Any],
    headers: dict[str, str],
    *,
    raw: str | None,
) -> Response:
    usage = body.get("usage")
    if isinstance(usage, dict):
        ctx.completion_tokens = _count(usage.get("completion_tokens"))
        ctx.engine_prompt_tokens = _count(usage.get("prompt_tokens"))
    ctx.finish_reasons = _finish_reasons(body)
    if not note_handoff(state, ctx, parse_handoff(body)):
        await finish(state, ctx, Phase.FAILED, status=502, code="handoff_mismatch")
        raise _with_headers(handoff_refused(), headers)
    try:
        result = relay_body(
            ctx.endpoint,
            body,
            _open_guard(state, ctx),
            screen_side=_screens_side(state),
            side_prefilter=_side_prefilter(state),
            raw=raw,
        )
    except InvalidUpstream as exc:
        err = UpstreamFailed("the engine sent an invalid answer")
        await finish(state, ctx, Phase.FAILED, status=502, code=err.code)
        raise _with_headers(err, headers) from exc
    if isinstance(result, Cut):
        raise await _cut_error(state, ctx, result, headers)
    ctx.first_byte_s = ctx.elapsed_s()
    latency.answered(state, ctx)
    await finish(state, ctx, Phase.COMPLETED, status=200)
    return JSONResponse(result, headers=headers)


def _finish_reasons(body: dict[str, Any]) -> tuple[str, ...]:
    """Each choice's ``finish_reason`` in a whole (non-streamed) answer, for the span."""
    choices = body.get("choices")
    if not isinstance(choices, list):
        return ()
    reasons = (c.get("finish_reason") for c in choices[:MAX_CHOICES] if isinstance(c, dict))
    return tuple(r[:64] for r in reasons if isinstance(r, str))


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


async def _report_cut(state: GatewayState, ctx: RequestContext, cut: Cut) -> None:
    if state.hooks.on_cut is not None:
        with anyio.CancelScope(shield=True):
            try:
                await state.hooks.on_cut(ctx.info(), cut)
            except Exception:
                log.exception("on_cut hook failed for request %s", ctx.request_id)


def _with_headers(err: GatewayError, headers: dict[str, str]) -> GatewayError:
    err.headers.update(headers)
    return err


async def _open_stream(
    state: GatewayState, ctx: RequestContext, call: UpstreamCall, *, wants_usage: bool
) -> Response:
    headers = {**_reply_headers(ctx), "Cache-Control": "no-cache"}
    try:
        opened = await state.upstream_for(call.spec).stream(call)
    except UpstreamUnreachable as exc:
        log.warning("engine %s unreachable: %s", call.spec.name, exc)
        await finish(state, ctx, Phase.FAILED, status=502, code="upstream_error", refund_all=True)
        raise _with_headers(UpstreamFailed("the engine could not be reached"), headers) from exc
    if isinstance(opened, UpstreamReply):
        raise await _refused_reply(state, ctx, opened, headers)
    ctx.advance(Phase.STREAMING)
    relay = StreamRelay(
        endpoint=ctx.endpoint,
        open_guard=_open_guard(state, ctx),
        wants_usage=wants_usage,
        refuse_handoff_mismatch=state.settings.refuse_on_handoff_mismatch,
        screen_side=_screens_side(state),
        side_prefilter=_side_prefilter(state),
    )
    events = _relay_events(state, ctx, opened, relay)
    return GuardedStreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _relay_events(
    state: GatewayState, ctx: RequestContext, opened: Any, relay: StreamRelay
) -> AsyncIterator[bytes]:
    splitter = SseSplitter()
    try:
        async for chunk in opened.chunks():
            for raw in splitter.feed(chunk):
                step = relay.on_event(raw)
                latency.tick(state, ctx, relay.text_events)
                if relay.saw_text and ctx.first_token_s is None:
                    ctx.first_token_s = ctx.elapsed_s() - (ctx.forwarded_s or 0.0)
                for out in step.out:
                    if ctx.first_byte_s is None:
                        ctx.first_byte_s = ctx.elapsed_s()
                    yield out
                if step.end is not None:
                    await _end_stream(state, ctx, relay, step.end, step.code)
                    return
        step = relay.on_upstream_end()
        for out in step.out:
            yield out
        await _end_stream(state, ctx, relay, step.end or Phase.FAILED, step.code)
    except UpstreamUnreachable:
        step = relay.on_upstream_end()
        await _end_stream(state, ctx, relay, step.end or Phase.FAILED, step.code)
        for out in step.out:
            yield out
    finally:
        with anyio.CancelScope(shield=True):
            await opened.aclose()
            if ctx.phase not in TERMINAL:  # the client went away (or we were cancelled)
                await finish(state, ctx, Phase.CANCELLED, status=499, code="client_disconnected")


async def _end_stream(
    state: GatewayState, ctx: RequestContext, relay: StreamRelay, end: Phase, code: str | None
) -> None:
    ctx.completion_tokens = relay.completion_tokens
    ctx.engine_prompt_tokens = relay.prompt_tokens
    ctx.finish_reasons = tuple(relay.finish_reasons)
    note_handoff(state, ctx, relay.handoff)
    if end is Phase.CUT and relay.cut is not None:
        await _report_cut(state, ctx, relay.cut)
    status = 200 if end is Phase.COMPLETED else (relay.cut.status if relay.cut else 502)
    await finish(state, ctx, end, status=status, code=code)


class GuardedStreamingResponse(StreamingResponse):
    """A streaming response that always closes its body iterator, however the send ends.

    Starlette cancels the sending task when the client disconnects; a generator suspended at a
    ``yield`` would otherwise be finalised only by the garbage collector, holding the tenant's
    concurrency lease and the engine connection until then.
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            closer = getattr(self.body_iterator, "aclose", None)
            if closer is not None:
                with anyio.CancelScope(shield=True):
                    await closer()
