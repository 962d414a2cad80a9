"""``POST /v1/embeddings``: a tenant's embeddings request, passed through to an engine that serves
them, with the same limits, capacity routing and content-free audit as a completion.

``serve_embeddings`` owns the request in one ``try/finally`` (as ``gateway.proxy.service.Flight``
does a completion's), in order:

1. route: engines that serve the model and may serve now (404 unknown model, 503 all blocked);
   of those, the kinds that can serve embeddings -- the bundled engine serves none, so a model
   only it serves is a 404 naming the model and the endpoint;
2. limits: one atomic take of the request, a token bound and a concurrency lease
   (``gateway.proxy.admission.take_lease``; the bound is ``EmbeddingsBody.token_bound``: at most
   one token per UTF-8 byte and a few special tokens per input -- counting each input on the
   engine's tokenizer would cost a call per input);
3. forward: the least in-flight engine gets the body as the client wrote it (the upstream layer:
   the engine's own ``/v1/embeddings``, or ``litellm.aembedding`` for providers); an engine that
   does not serve the route (vLLM registers it only for a model with the ``embed`` task:
   ``entrypoints/pooling/__init__.py``; older vLLM answers 400 "The model does not support
   Embeddings API"; SGLang 400 "This model does not appear to be an embedding model") is the
   same 404; its other 4xx pass through, their message screened by the response guards as a
   completion engine's are (a cut is the guard's error, reported through ``on_cut``);
4. the ``finally`` applies the ending (``gateway.proxy.finish``): the lease released with the
   bound less the engine's ``usage.prompt_tokens`` given back, the in-flight slot freed, the audit
   row (counts only), metrics, span.

Embeddings are vectors, not text a model wrote: no response guard screens them (there is nothing
a marker could be copied into), and no request hook adds to the input. Every other string of the
answer (its ids, model, object names, keys, an engine's extension fields) is the engine's, and
goes through the side screen as a completion's side fields do (``gateway.proxy.side``): a marker
there cuts the answer (``GuardCut``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import anyio
from fastapi.responses import JSONResponse
from starlette.responses import Response

from contracts.engine import REQUEST_ID_HEADER, TENANT_HEADER
from contracts.plugins import Cut
from gateway.domain import Principal
from gateway.engines.capacity import RequestSize
from gateway.engines.registry import EngineRecord
from gateway.engines.spec import EngineKind
from gateway.errors import (
    GatewayError,
    ModelNotFound,
    NoHealthyEngine,
    Stopped,
    UpstreamFailed,
)
from gateway.lifecycle import Phase
from gateway.openai.schemas import EmbeddingsBody
from gateway.proxy.admission import route, take_lease
from gateway.proxy.body import refusal_of
from gateway.proxy.context import RequestContext, open_request
from gateway.proxy.deps import ProxyDeps
from gateway.proxy.ending import CLIENT_GONE, COMPLETED, INTERNAL, Outcome, cut, refused
from gateway.proxy.finish import finish
from gateway.proxy.relay import OpenGuard
from gateway.proxy.side import SideScreen
from gateway.proxy.side_fields import EMBEDDING_PATH, InvalidSide
from gateway.upstream.base import Endpoint, UpstreamCall, UpstreamReply, UpstreamUnreachable

log = logging.getLogger("kvguard.gateway.proxy")

NO_EMBEDDINGS_KINDS = frozenset({EngineKind.BUNDLED})  # kvguard's own engine generates only
# What an engine without embeddings answers on the route (see the module docstring).
NOT_SERVED_WORDS = ("does not support embeddings api", "does not appear to be an embedding model")


class GuardCut(Exception):
    """A response guard stopped the engine's answer or error message."""

    def __init__(self, verdict: Cut) -> None:
        super().__init__(verdict.code)
        self.verdict = verdict


def not_served(model: str) -> ModelNotFound:
    return ModelNotFound(
        f"model '{model[:256]}' serves no embeddings here: no engine serving it answers "
        f"POST {Endpoint.EMBEDDINGS.path}",
        param="model",
    )


async def serve_embeddings(
    deps: ProxyDeps,
    *,
    principal: Principal,
    body: EmbeddingsBody,
    request_id: str,
    incoming_headers: Mapping[str, str],
) -> Response:
    ctx = open_request(
        deps.tracing,
        request_id=request_id,
        principal=principal,
        endpoint=Endpoint.EMBEDDINGS,
        model=body.model,
        stream=False,
        incoming_headers=incoming_headers,
    )
    outcome = Outcome(CLIENT_GONE)  # what a cancelled request leaves
    try:
        outcome = await _outcome(deps, ctx, body)
    finally:
        await finish(deps, ctx, outcome.ending)
    assert isinstance(outcome.reply, Response)
    return outcome.reply


async def _outcome(deps: ProxyDeps, ctx: RequestContext, body: EmbeddingsBody) -> Outcome:
    try:
        answer = await _serve(deps, ctx, body)
    except GatewayError as err:
        reply = err.response(headers=ctx.rate_limit_headers)
        return Outcome(refused(err, engine_answered=ctx.answered), reply)
    except GuardCut as stopped:
        await _report_cut(deps, ctx, stopped.verdict)
        return Outcome(cut(stopped.verdict), Stopped(stopped.verdict).response())
    except Exception:
        log.exception("request %s failed inside the gateway", ctx.request_id)
        return Outcome(INTERNAL, GatewayError("internal gateway error").response())
    return Outcome(COMPLETED, JSONResponse(answer, headers=ctx.rate_limit_headers))


async def _serve(deps: ProxyDeps, ctx: RequestContext, body: EmbeddingsBody) -> dict[str, Any]:
    serving = [r for r in route(deps, ctx.model) if r.spec.kind not in NO_EMBEDDINGS_KINDS]
    ctx.advance(Phase.ROUTED)
    if not serving:
        raise not_served(ctx.model)
    size = RequestSize(prompt_tokens=body.token_bound(), max_tokens=0)
    ctx.prompt_tokens, ctx.max_tokens = size.prompt_tokens, 0
    ctx.lease = await take_lease(deps, ctx, size)
    ctx.advance(Phase.ADMITTED)
    engine = deps.registry.choose(serving)
    _forwarding(deps, ctx, engine)
    headers = {TENANT_HEADER: ctx.principal.tenant_id, REQUEST_ID_HEADER: ctx.request_id}
    call = UpstreamCall(
        spec=engine.spec, endpoint=ctx.endpoint, body=body.upstream_body(), headers=headers
    )
    try:
        reply = await deps.upstream_for(engine.spec).complete(call)
    except UpstreamUnreachable as exc:
        log.warning("engine %s unreachable: %s", engine.name, exc)
        raise UpstreamFailed("the engine could not be reached") from exc
    guards, info = deps.hooks.guards, ctx.info()
    if reply.status != 200:
        raise _refusal(ctx.model, reply, lambda: guards.open(info))
    answer = reply.body
    if answer is None or not isinstance(answer.get("data"), list):
        raise UpstreamFailed("the engine sent an invalid answer")
    if guards.capabilities.screens_side:  # every string but the vectors, as a side field
        try:
            side = SideScreen(lambda: guards.open(info), text=EMBEDDING_PATH)
            screened = side.screen_body(answer)
        except InvalidSide as exc:
            raise UpstreamFailed("the engine sent an invalid answer") from exc
        if isinstance(screened, Cut):
            raise GuardCut(screened)
        answer = screened
    ctx.answered = True
    usage = answer.get("usage")
    used = usage.get("prompt_tokens") if isinstance(usage, dict) else None
    if isinstance(used, int) and not isinstance(used, bool) and used >= 0:
        ctx.prompt_tokens = ctx.engine_prompt_tokens = used  # settles the bound's charge
    ctx.completion_tokens = 0
    ctx.first_byte_s = ctx.elapsed_s()
    return answer


def _forwarding(deps: ProxyDeps, ctx: RequestContext, engine: EngineRecord) -> None:
    ctx.engine = engine
    engine.in_flight += 1
    deps.metrics.later(deps.metrics.in_flight_of, (ctx.principal.tenant_id,))
    ctx.advance(Phase.FORWARDED)
    ctx.forwarded_s = ctx.elapsed_s()
    ctx.span.set_attribute("kvguard.engine", engine.name)


async def _report_cut(deps: ProxyDeps, ctx: RequestContext, verdict: Cut) -> None:
    on_cut = deps.hooks.on_cut
    if on_cut is not None:
        with anyio.CancelScope(shield=True):
            try:
                await on_cut(ctx.info(), verdict)
            except Exception:
                log.exception("on_cut hook failed for request %s", ctx.request_id)


def _refusal(model: str, reply: UpstreamReply, open_guard: OpenGuard) -> GatewayError:
    """An engine's non-200 answer: the route not served is the gateway's 404; its own 4xx pass
    through (screened: ``GuardCut``); an overloaded engine is a 503; anything else a 502."""
    error = (reply.body or {}).get("error")
    message = str(error.get("message") or "")[:2000] if isinstance(error, dict) else ""
    if reply.status == 404 or any(w in message.lower() for w in NOT_SERVED_WORDS):
        return not_served(model)
    if 400 <= reply.status < 500 and reply.status != 429 and isinstance(error, dict):
        refusal = refusal_of(reply.status, error, open_guard)
        if isinstance(refusal, Cut):
            raise GuardCut(refusal)
        return refusal
    if reply.status in (429, 503):
        return NoHealthyEngine("the engine is overloaded; retry later", code="engine_overloaded")
    return UpstreamFailed(f"the engine answered HTTP {reply.status}")
