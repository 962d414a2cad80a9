"""Admission of one tenant request, before any engine does work for it.

Phases, in order (each refuses with an OpenAI-style error, nothing reserved yet):

1. route: engines that serve the model and may serve now (404 unknown model, 503 if all blocked);
2. surface: of those, the engines whose kind takes every field the request uses
   (``gateway.openai.surface``); none: 400 ``unsupported_parameter`` naming the field and engine;
3. hooks: request hooks may rewrite the upstream body (canary markers are counted like text);
4. count: exact prompt tokens of what the engine renders (tool definitions included) -- applied
   here when the engine reports a tokenizer this release can apply itself (the bundled byte
   tokenizer and chat format), else from the engine's own tokenize route, sent every field its
   chat template renders (``gateway.engines.prompt``); an upper bound for declared engines;
5. max_tokens: the client's, or as many as fit (the largest max_request_tokens among the engines
   less the prompt), at most ``default_max_tokens_cap`` and what the plan's tokens per minute
   leave for each of the ``n`` choices;
6. fit: prompt + max_tokens <= min(window, every role's real pool, engine limits, plan cap)
   on at least one engine (400 ``context_length_exceeded`` stating the real limit and the size;
   if engines turned unavailable while the prompt was counted, route again: 503, never a 400);
   a request that fits only without what the hooks added is sent as the client wrote it;
7. limits: one atomic take of request, tokens (prompt + n x max_tokens: the prompt is read once;
   the tenant's own prompt: a canary marker's tokens count for capacity, never against its
   budget) and a concurrency lease (429 + Retry-After; 503 if the shared limiter is down, unless
   configured to fail open); the buckets' levels that take saw become OpenAI's
   ``x-ratelimit-*`` headers of the answer, a 429 included (``ctx.rate_limit_headers``);
8. choose: least in-flight among the engines the request fits; the body loses what that engine
   does not take (``surface.for_engine``);
9. isolate: the chosen engine's prefix-cache salt is set from the tenant (never the client's).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from contracts.chat_format import TOKENIZER_ID, count_tokens
from contracts.plugins import RequestRefused
from gateway.engines.adapters import AdapterError, adapter_for
from gateway.engines.capacity import RequestSize, fits, max_request_tokens_for
from gateway.engines.isolation import isolate
from gateway.engines.registry import EngineRecord
from gateway.errors import (
    ContextLengthExceeded,
    InvalidRequest,
    LimiterDown,
    ModelNotFound,
    NoHealthyEngine,
    RateLimited,
    UpstreamFailed,
    context_length_message,
)
from gateway.lifecycle import Phase
from gateway.limits.base import Lease, LimiterUnavailable, Refusal, rate_limit_headers
from gateway.openai import surface
from gateway.openai.schemas import ChatCompletionBody, CompletionBody
from gateway.proxy.context import RequestContext
from gateway.proxy.deps import ProxyDeps

log = logging.getLogger("kvguard.gateway.admission")

Body = ChatCompletionBody | CompletionBody
Narrow = Callable[[list[EngineRecord]], list[EngineRecord]]


@dataclass(frozen=True, slots=True)
class ParamNames:
    """The request's fields as its client named them, for a refusal's ``param`` and words: the
    prompt's and the completion size's (None: the client set none). A translated request (the
    Responses API's, as a chat completion) names its own (``input``, ``max_output_tokens``)."""

    prompt: str
    completion: str | None

    @classmethod
    def of(cls, body: Body) -> ParamNames:
        prompt = "messages" if isinstance(body, ChatCompletionBody) else "prompt"
        return cls(prompt, body.max_tokens_param())


@dataclass(frozen=True, slots=True)
class Admitted:
    engine: EngineRecord
    size: RequestSize
    body: dict[str, Any] = field(repr=False)


async def admit(
    deps: ProxyDeps,
    ctx: RequestContext,
    body: Body,
    *,
    narrow: Narrow | None = None,
    names: ParamNames | None = None,
) -> Admitted:
    """``narrow``: keeps the engines that serve what the request asks beyond ``body`` (the
    Responses API's own fields, ``gateway.responses.surface``), or raises its refusal;
    ``names``: the client's names of ``body``'s fields when it translates another request."""
    routable = route(deps, ctx.model, narrow)
    ctx.advance(Phase.ROUTED)
    routable, unsupported = surface.serving(routable, surface.requested(body))
    if not routable:
        assert unsupported is not None
        raise unsupported
    plain_body = body.upstream_body(max_tokens=body.requested_max_tokens() or 1)
    upstream_body = plain_body
    for hook in deps.hooks.request_hooks:
        try:
            upstream_body = await hook.prepare(ctx.info(), upstream_body)
        except RequestRefused as refusal:
            raise InvalidRequest(refusal.message, code=refusal.code) from refusal
    plan_cap = ctx.principal.plan.max_context_tokens
    own: int | None = None  # the client's own prompt tokens, when a hook added to them
    if upstream_body is not plain_body:
        own = await count_prompt(deps, routable, plain_body, ctx)
    size, fitting = await _measure(deps, routable, upstream_body, ctx, body, plan_cap, own)
    if not fitting and upstream_body is not plain_body:
        # What a hook added (a canary marker) must never be the reason a request is refused:
        # send it as the client wrote it, or refuse it with the client's own size.
        upstream_body, own = plain_body, None
        size, fitting = await _measure(deps, routable, plain_body, ctx, body, plan_cap, own)
    upstream_body["max_tokens"] = size.max_tokens
    # Capacity counts what the engine reads (``size``); the tenant is billed and limited for what
    # it sent: the hooks' tokens (a canary marker) are hidden from its count and its usage.
    hidden = 0 if own is None else max(0, size.prompt_tokens - own)
    ctx.prompt_tokens, ctx.hidden_prompt_tokens = size.prompt_tokens - hidden, hidden
    ctx.max_tokens = size.max_tokens * body.choices
    if not fitting:
        # Counting awaited the engine: an engine that became unavailable meanwhile now reports
        # a limit of 0. That is a 503 (route again), never a "too long" 400 the client would
        # not retry.
        routable = route(deps, ctx.model, narrow)
        fitting = _fitting(routable, size, plan_cap)
    if not fitting:
        names = names or ParamNames.of(body)
        raise too_long(
            routable, size, plan_cap, param=names.prompt, completion_param=names.completion
        )
    ctx.lease = await take_lease(deps, ctx, size, choices=body.choices, hidden=hidden)
    ctx.advance(Phase.ADMITTED)
    engine = deps.registry.choose(fitting)
    upstream_body = isolate(
        surface.for_engine(upstream_body, engine),
        engine.snapshot,
        key=deps.settings.cache_salt,
        tenant_id=ctx.principal.tenant_id,
    )
    return Admitted(engine=engine, size=size, body=upstream_body)


async def _measure(
    deps: ProxyDeps,
    routable: list[EngineRecord],
    upstream_body: dict[str, Any],
    ctx: RequestContext,
    body: Body,
    plan_cap: int | None,
    own: int | None,
) -> tuple[RequestSize, list[EngineRecord]]:
    prompt_tokens = await count_prompt(deps, routable, upstream_body, ctx)
    max_tokens = body.requested_max_tokens()
    if max_tokens is None:
        billed = prompt_tokens if own is None else own
        max_tokens = _as_much_as_fits(deps, ctx, routable, prompt_tokens, billed, body.choices)
    size = RequestSize(prompt_tokens=prompt_tokens, max_tokens=max_tokens)
    return size, _fitting(routable, size, plan_cap)


def _as_much_as_fits(
    deps: ProxyDeps,
    ctx: RequestContext,
    routable: list[EngineRecord],
    prompt_tokens: int,
    billed_prompt: int,
    choices: int,
) -> int:
    """A request without max_tokens may generate what fits after its prompt on the roomiest
    engine, at most the operator's cap and what the plan's tokens per minute leave each choice
    after the prompt the tenant is billed for (``billed_prompt``: without a canary marker).
    At least 1: a prompt that leaves no room is refused as too long, by the same check as any."""
    plan = ctx.principal.plan
    limits = [
        max_request_tokens_for(r.snapshot, plan.max_context_tokens) for r in routable if r.snapshot
    ]
    room = max(limits, default=0) - prompt_tokens
    cap = deps.settings.default_max_tokens_cap
    if cap is not None:
        room = min(room, cap)
    if plan.rate_limited and plan.tokens_per_minute is not None:
        room = min(room, (plan.tokens_per_minute - billed_prompt) // choices)
    return max(1, room)


def _fitting(
    routable: list[EngineRecord], size: RequestSize, plan_cap: int | None
) -> list[EngineRecord]:
    return [r for r in routable if r.snapshot is not None and fits(r.snapshot, size, plan_cap)]


def route(deps: ProxyDeps, model: str, narrow: Narrow | None = None) -> list[EngineRecord]:
    routable, blocked = deps.registry.serving(model)
    if routable:
        return routable if narrow is None else narrow(routable)
    if not blocked:
        raise ModelNotFound(f"model '{model}' is not served here", param="model")
    reasons = sorted({str(deps.registry.block(record)) for record in blocked})
    raise NoHealthyEngine(
        f"no healthy engine for model '{model}' (engines blocked: {', '.join(reasons)})"
    )


async def count_prompt(
    deps: ProxyDeps, routable: list[EngineRecord], body: dict[str, Any], ctx: RequestContext
) -> int:
    """Exact count of what the engine will render (the messages, and the tools and other fields
    its chat template writes: ``gateway.engines.prompt``): here, when an engine reports the
    countable tokenizer (its template renders messages only); else from the first engine whose
    tokenizer answers (all serve the same model)."""
    messages = body.get("messages")
    prompt = body.get("prompt")
    countable = not body.get("tools")  # the local count renders messages only
    if countable and any(
        r.snapshot is not None and r.snapshot.tokenizer == TOKENIZER_ID for r in routable
    ):
        local = count_tokens(prompt, messages)
        if local is not None:
            deps.metrics.later(deps.metrics.token_counts_of, ("local",))
            return local
    deps.metrics.later(deps.metrics.token_counts_of, ("engine",))
    for record in routable:
        try:
            return await adapter_for(record.spec).count_tokens(
                deps.client,
                model=ctx.model,
                body=body,
                timeout=deps.settings.engine_timeout_s,
                snapshot=record.snapshot,
            )
        except AdapterError as exc:
            log.warning("token count on engine %s failed: %s", record.name, exc)
    raise UpstreamFailed(
        "could not count the prompt's tokens on any engine", code="token_count_unavailable"
    )


def too_long(
    routable: list[EngineRecord],
    size: RequestSize,
    plan_cap: int | None,
    *,
    param: str,
    completion_param: str | None = None,
) -> ContextLengthExceeded:
    """The context-length 400 in OpenAI's words (``gateway.errors.context_length_message``),
    naming the request parameter that set the completion's size (``completion_param``; None: the
    request set none and the gateway's default did)."""

    def largest(record: EngineRecord) -> int:
        return max_request_tokens_for(record.snapshot, plan_cap) if record.snapshot else 0

    snapshot = max(routable, key=largest).snapshot
    assert snapshot is not None
    max_request_tokens = max_request_tokens_for(snapshot, plan_cap)
    if snapshot.max_prompt_tokens is not None and size.prompt_tokens > snapshot.max_prompt_tokens:
        message = context_length_message(
            limit=snapshot.max_prompt_tokens,
            prompt_tokens=size.prompt_tokens,
            completion_tokens=None,
            prompt_name=param,
            reason="The engine accepts at most this many prompt tokens.",
        )
        return ContextLengthExceeded(message, param=param)
    reason = ""
    if plan_cap is not None and max_request_tokens == plan_cap:
        reason = "The limit is your plan's context limit."
    elif snapshot.real_pool is not None and max_request_tokens < snapshot.context_window:
        reason = (
            f"The limit is the engine's real capacity; its advertised window is "
            f"{snapshot.context_window} tokens."
        )
    prompt_alone = completion_param is None and size.prompt_tokens >= max_request_tokens
    message = context_length_message(
        limit=max_request_tokens,
        prompt_tokens=size.prompt_tokens,
        completion_tokens=None if prompt_alone else size.max_tokens,
        prompt_name=param,
        completion_param=completion_param,
        reason=reason,
    )
    return ContextLengthExceeded(message, param=param)


async def take_lease(
    deps: ProxyDeps,
    ctx: RequestContext,
    size: RequestSize,
    *,
    choices: int = 1,
    hidden: int = 0,
) -> Lease | None:
    """The tenant's limits, for the tokens it sent (``hidden``: prompt tokens a hook added, which
    capacity counts and the tenant's tokens per minute do not)."""
    plan = ctx.principal.plan
    if not plan.rate_limited:
        return None
    tokens = size.prompt_tokens - hidden + size.max_tokens * choices
    try:
        result = await deps.limiter.admit(
            tenant_id=ctx.principal.tenant_id, plan=plan, tokens=tokens
        )
    except LimiterUnavailable as exc:
        deps.metrics.limiter_up.set(0)
        if deps.settings.limiter_fail_open:
            deps.metrics.limiter_fail_open.inc()
            log.warning(
                "limiter down (%s); letting tenant %s through", exc, ctx.principal.tenant_id
            )
            return None
        raise LimiterDown("rate limiter unavailable; request refused") from exc
    ctx.rate_limit_headers = rate_limit_headers(result.levels)  # on the answer, whatever it is
    if isinstance(result, Refusal):
        raise refused(deps, ctx, result, tokens)
    return result


def refused(
    deps: ProxyDeps, ctx: RequestContext, refusal: Refusal, tokens: int
) -> InvalidRequest | RateLimited:
    deps.metrics.rate_limited.labels(tenant=ctx.principal.tenant_id, limit=refusal.kind.value).inc()
    if refusal.retry_after_s is None:
        return InvalidRequest(
            f"This request needs {tokens} tokens, more than your plan's "
            f"{ctx.principal.plan.tokens_per_minute} tokens per minute.",
            code="exceeds_tokens_per_minute",
        )
    return RateLimited(
        f"Rate limit reached ({refusal.kind.value}); retry after {refusal.retry_after_s} s.",
        retry_after_s=refusal.retry_after_s,
        headers=ctx.rate_limit_headers,
    )
