"""The tenant request path end to end, owned by one ``Flight``: admit -> forward -> relay -> finish.

``serve_completion`` runs the request's whole life in ``Flight.run``, answering through a
``Reply`` (``gateway.proxy.reply``: ASGI, or direct to the socket), inside one ``try/finally``:

1. admit (``gateway.proxy.admission``): route, count, fit, take the tenant's concurrency lease;
2. forward: take the engine's in-flight slot and call the engine -- for a whole answer
   (``_answer``), or for a stream relayed event by event as it arrives (``_stream``);
3. whatever happens becomes one ``Outcome`` (``gateway.proxy.ending``): an answer delivered, a
   refusal raised by any phase (a ``GatewayError``), a response guard's cut, a bug (logged; a 500,
   or an error event once a stream is open), or the client going away -- the reply's watch
   cancels the flight, whether it waits for the engine or streams (a stream is pumped from the
   engine's reads to the client by ``gateway.proxy.stream.StreamPump``);
4. the ``finally`` applies the ending (``gateway.proxy.finish``: the lease released with its
   refund, the in-flight slot freed, the audit row, metrics, span, ``on_finish``) once the
   reply's watch has ended, so it runs however the flight ends; only then is the rest of the
   reply sent, so a client that has read its whole answer finds it audited.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Mapping
from typing import Any, NoReturn

from starlette.responses import Response

from contracts.engine import REQUEST_ID_HEADER, TENANT_HEADER, HandoffProof, handoff_of
from contracts.plugins import ENGINE_HEADER, Cut
from gateway.domain import Principal
from gateway.errors import (
    GatewayError,
    HandoffMismatch,
    NoHealthyEngine,
    Stopped,
    UpstreamFailed,
)
from gateway.lifecycle import Phase
from gateway.proxy import latency
from gateway.proxy.admission import Admitted, Body, admit
from gateway.proxy.body import off_loop, on_loop, refusal_of, relay_body
from gateway.proxy.chunks import MAX_CHOICES, InvalidUpstream, own_usage, token_count
from gateway.proxy.context import RequestContext, open_request
from gateway.proxy.deps import ProxyDeps
from gateway.proxy.disclosure import Disclosure
from gateway.proxy.ending import (
    CLIENT_GONE,
    COMPLETED,
    INTERNAL,
    Answer,
    Outcome,
    cut,
    refused,
    stream_ended,
)
from gateway.proxy.finish import finish
from gateway.proxy.relay import StreamRelay, error_event
from gateway.proxy.reply import AsgiReply, ClientGone, DirectReply, Watch
from gateway.proxy.stream import RelayedStream, StreamPump, TokenClock
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
    reply: AsgiReply,
    principal: Principal,
    body: Body,
    endpoint: Endpoint,
    request_id: str,
    incoming_headers: Mapping[str, str],
) -> None:
    ctx = open_request(
        deps.tracing,
        request_id=request_id,
        principal=principal,
        endpoint=endpoint,
        model=body.model,
        stream=body.stream,
        incoming_headers=incoming_headers,
    )
    await Flight(deps, ctx, body, reply).run()


class Flight:
    """One tenant request's context, lease and in-flight slot, from admission to the end."""

    def __init__(self, deps: ProxyDeps, ctx: RequestContext, body: Body, reply: AsgiReply) -> None:
        self.deps = deps
        self.ctx = ctx
        self.body = body
        self.reply = reply
        self._streaming = False  # the stream's head went out: errors become error events
        task = asyncio.current_task()  # a flight is made in its request's task
        assert task is not None
        self._watch = Watch(task)
        # every guard of the answer, for the kvguard object (gateway.proxy.disclosure); the
        # factory refers to the parts it uses, not to this flight (no reference cycle: a flight
        # is freed when it ends, not by the garbage collector)
        guards, info = deps.hooks.guards, ctx.info
        self.disclosure = Disclosure(ctx.request_id, on_loop(lambda: guards.open(info())))

    async def run(self) -> None:
        outcome = Outcome(CLIENT_GONE)  # what a cancelled flight leaves
        try:
            outcome = await self._watched()
        finally:
            await finish(self.deps, self.ctx, outcome.ending)
        reply, out = outcome.reply, self.reply
        try:
            if isinstance(reply, Answer):
                await out.json(200, reply.body, reply.headers)
            elif isinstance(reply, Response):
                await out.respond(reply)
            elif reply is not None:
                await out.end_stream(reply)
        except ClientGone:
            pass  # audited already; nothing is left to send to anyone

    async def _watched(self) -> Outcome:
        """The outcome, or ``CLIENT_GONE`` when the client disconnects first (the reply's watch
        cancels the flight; the parts it holds, ``on_cut`` and closing the stream, finish first).
        Any other cancellation (the server's) propagates."""
        watch = self._watch
        self.reply.watch(watch)
        try:
            return await self._outcome()
        except asyncio.CancelledError:
            if watch.claims():
                return Outcome(CLIENT_GONE)
            raise
        finally:
            self.reply.unwatch()

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

    def _forward(self, admitted: Admitted, endpoint: Endpoint | None = None) -> UpstreamCall:
        """Take the engine's in-flight slot and build its call (to ``endpoint``: the request's
        own unless given, as for a Responses request sent to an engine as a chat completion)."""
        ctx, deps = self.ctx, self.deps
        endpoint = endpoint or ctx.endpoint
        ctx.engine = admitted.engine
        ctx.engine.in_flight += 1
        m = deps.metrics
        m.later(m.in_flight_of, (ctx.principal.tenant_id,))
        ctx.advance(Phase.FORWARDED)
        ctx.forwarded_s = ctx.elapsed_s()
        m.later(m.overhead_seconds_of, (ctx.endpoint.value,), ctx.forwarded_s)
        ctx.span.set_attribute("kvguard.engine", admitted.engine.name)
        ctx.span.set_attribute("kvguard.prompt_tokens", admitted.size.prompt_tokens)
        ctx.span.set_attribute("gen_ai.request.max_tokens", admitted.size.max_tokens)
        headers = {TENANT_HEADER: ctx.principal.tenant_id, REQUEST_ID_HEADER: ctx.request_id}
        spec = admitted.engine.spec
        ctx.upstream_span = deps.tracing.start_upstream(
            ctx.span,
            base_url=spec.base_url,
            route=endpoint.path,
            provider=spec.kind.value,
            model=str(admitted.body.get("model") or ctx.model),
            max_tokens=admitted.size.max_tokens,
            headers=headers,
        )
        return UpstreamCall(
            spec=admitted.engine.spec, endpoint=endpoint, body=admitted.body, headers=headers
        )

    # -- replies ---------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        # the request id headers are every answer's (gateway.api.request_ids); the rate-limit
        # headers those of a limited tenant (gateway.proxy.admission.take_lease)
        if self.ctx.principal.synthetic and self.ctx.engine is not None:
            return {ENGINE_HEADER: self.ctx.engine.name}  # canary probes report per engine
        return self.ctx.rate_limit_headers

    def _error(self, err: GatewayError) -> Response | bytes:
        """The error as a response, or as the last event of a stream already open."""
        if self._streaming:
            return error_event(err.message, err.code, err.type_)
        return err.response(headers=self._headers())

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
            ctx.completion_tokens = token_count(usage.get("completion_tokens"))
            ctx.engine_prompt_tokens = token_count(usage.get("prompt_tokens"))
        ctx.finish_reasons = _finish_reasons(body)
        self._check_handoff(handoff_of(body))
        capabilities = self.deps.hooks.guards.capabilities
        try:
            relay = functools.partial(
                relay_body,
                ctx.endpoint,
                body,
                self.disclosure.open,
                screen_side=capabilities.screens_side,
                side_prefilter=capabilities.side_prefilter,
                raw=reply.raw,
            )
            result = await off_loop(len(reply.raw or ""), relay)
        except InvalidUpstream as exc:
            raise UpstreamFailed("the engine sent an invalid answer") from exc
        if isinstance(result, Cut):
            return await self._cut(result)
        if ctx.hidden_prompt_tokens and isinstance(result.get("usage"), dict):
            result = own_usage(result, ctx.hidden_prompt_tokens)  # the tenant's own usage
        result = self.disclosure.on_answer(result, ctx.handoff)
        ctx.first_byte_s = ctx.elapsed_s()
        latency.answered(self.deps, ctx)
        return Outcome(COMPLETED, Answer(result, {**self._headers(), **self.disclosure.headers()}))

    async def _call_engine(self, call: UpstreamCall) -> UpstreamReply:
        try:
            return await self.deps.upstream_for(call.spec).complete(call)
        except UpstreamUnreachable as exc:
            self._unreachable(call, exc)

    def _unreachable(self, call: UpstreamCall, exc: UpstreamUnreachable) -> NoReturn:
        log.warning(
            "request %s: engine %s (%s) unreachable: %s",
            self.ctx.request_id,
            call.spec.name,
            call.spec.base_url,
            exc,
        )
        raise UpstreamFailed("the engine could not be reached") from exc

    async def _engine_refused(self, reply: UpstreamReply) -> Outcome:
        """An engine's non-200 answer: its own 4xx passes through (screened, no address in it),
        else a 502/503 naming no engine (the log names it, by request id)."""
        error = (reply.body or {}).get("error")
        if 400 <= reply.status < 500 and reply.status != 429 and isinstance(error, dict):
            refusal = refusal_of(reply.status, error, self.disclosure.open)
            if isinstance(refusal, Cut):
                return await self._cut(refusal)
            raise refusal
        engine = self.ctx.engine
        log.warning(  # the engine's message may hold content: its code only
            "request %s: engine %s (%s) answered HTTP %s, code %r",
            self.ctx.request_id,
            engine.name if engine is not None else "?",
            engine.spec.base_url if engine is not None else "?",
            reply.status,
            str(error.get("code"))[:64] if isinstance(error, dict) else None,
        )
        if reply.status in (429, 503):
            raise NoHealthyEngine("the engine is overloaded; retry later", code="engine_overloaded")
        raise UpstreamFailed(f"the engine answered HTTP {reply.status}")

    def _check_handoff(self, proof: HandoffProof | None) -> None:
        if not note_handoff(self.deps, self.ctx, proof):
            raise HandoffMismatch()

    async def _cut(self, verdict: Cut) -> Outcome:
        await self._report_cut(verdict)
        return Outcome(cut(verdict), self._error(Stopped(verdict)))

    async def _report_cut(self, verdict: Cut) -> None:
        on_cut = self.deps.hooks.on_cut
        if on_cut is not None:
            with self._watch.held():
                try:
                    await on_cut(self.ctx.info(), verdict)
                except Exception:
                    log.exception("on_cut hook failed for request %s", self.ctx.request_id)

    # -- a stream --------------------------------------------------------------------------------

    async def _stream(self, call: UpstreamCall, *, wants_usage: bool) -> Outcome:
        try:
            opened = await self.deps.upstream_for(call.spec).stream(call)
        except UpstreamUnreachable as exc:
            self._unreachable(call, exc)
        if isinstance(opened, UpstreamReply):
            return await self._engine_refused(opened)
        self.ctx.answered = True
        relay: RelayedStream | None = None
        try:
            self.ctx.advance(Phase.STREAMING)
            relay = self._stream_relay(wants_usage=wants_usage)
            self._streaming = True
            await self.reply.start_stream(self._headers())
            return await self._relay(opened, relay)
        finally:
            if relay is not None and relay.end is Phase.COMPLETED:
                opened.done_reading()  # read to its end: the connection may be kept
            with self._watch.held():
                await opened.aclose()

    def _stream_relay(self, *, wants_usage: bool) -> RelayedStream:
        """The relay of this request's event format (chat and completions: ``StreamRelay``)."""
        capabilities = self.deps.hooks.guards.capabilities
        return StreamRelay(
            endpoint=self.ctx.endpoint,
            open_guard=self.disclosure.open,
            wants_usage=wants_usage,
            refuse_handoff_mismatch=self.deps.settings.refuse_on_handoff_mismatch,
            screen_side=capabilities.screens_side,
            side_prefilter=capabilities.side_prefilter,
            hidden_prompt_tokens=self.ctx.hidden_prompt_tokens,
            disclosure=self.disclosure,
        )

    async def _relay(self, opened: UpstreamStream, relay: RelayedStream) -> Outcome:
        """The stream through the relay to the client: pushed from the engine connection's reads
        when both ends allow it (``DirectReply`` and a ``PushSource``), else pulled read by read.
        The bytes of one read leave in one write; the last ones wait for the single exit."""
        clock = TokenClock(self.deps.metrics.inter_token_seconds.bounds)
        pump = StreamPump(relay, self.reply, clock)
        direct = self.reply if isinstance(self.reply, DirectReply) else None
        source = opened.push() if direct is not None else None
        if direct is not None and source is not None:
            direct.throttle(source.pause, source.resume)
            source.attach(pump)
            await pump.done
        else:
            try:
                async for chunk in opened.chunks():
                    pump.data(chunk)
                    await self.reply.drain()
                    if pump.done.done():
                        break
                else:
                    pump.end()
            except UpstreamUnreachable as exc:
                pump.lost(exc)
        return await self._stream_ended(relay, pump)

    async def _stream_ended(self, relay: RelayedStream, pump: StreamPump) -> Outcome:
        ctx, clock = self.ctx, pump.clock
        ctx.clock = clock
        if clock.first_s is not None:
            ctx.first_token_s = clock.first_s - ctx.started_mono - (ctx.forwarded_s or 0.0)
        if pump.first_write_s is not None:
            ctx.first_byte_s = pump.first_write_s - ctx.started_mono
        ctx.completion_tokens = relay.completion_tokens
        ctx.engine_prompt_tokens = relay.prompt_tokens
        ctx.finish_reasons = tuple(relay.finish_reasons)
        note_handoff(self.deps, ctx, relay.handoff)
        end = relay.end or Phase.FAILED
        if end is Phase.CUT and relay.cut is not None:
            await self._report_cut(relay.cut)
        return Outcome(stream_ended(end, relay.end_code, relay.cut), pump.last)


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


def _finish_reasons(body: dict[str, Any]) -> tuple[str, ...]:
    """Each choice's ``finish_reason`` in a whole (non-streamed) answer, for the span."""
    choices = body.get("choices")
    if not isinstance(choices, list):
        return ()
    reasons = (c.get("finish_reason") for c in choices[:MAX_CHOICES] if isinstance(c, dict))
    return tuple(r[:64] for r in reasons if isinstance(r, str))
