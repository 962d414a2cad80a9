"""One OpenAI request through the engine: validate -> submit -> stream or collect.

Admission happens in ``submit`` before any response byte is sent, so an over-long request is a
plain 400 even when the client asked for a stream. A request for ``n`` choices is ``n`` engine
requests (ids ``<request id>.<index>``; a seeded one seeds choice i with ``seed + i``), admitted
together: if one is refused, the others are aborted and the request gets that refusal. After that,
a stream ends in exactly one way: each choice's finish chunk (plus usage when asked) and
``[DONE]``, or an error event and ``[DONE]`` as soon as any choice fails (an engine bug while its
answer is built, in the detokenizer or the stop matching, is such a failure: the choice is aborted,
the traceback logged, and the error is ``internal_error``; without streaming, a 500). A client
that goes away aborts every choice, which releases their pages.

A chat's answer is shaped by its ``OutputPlan`` (``backend.server.structured``): its grammar is
compiled before anything is submitted (a schema that cannot compile is a 400), each choice samples
under it, and a ``Shaper`` per choice turns the released text into content and tool calls, the
same way streamed or not.

Without ``max_tokens`` (or ``max_completion_tokens``) a choice may generate as many tokens as fit
the engine's limit after its prompt, as OpenAI and vLLM do.

Every response says how its KV came to be in a ``kvguard`` extension field (the non-streaming body,
the error body, and each choice's finish chunk): ``{"role": ..., "handoff": null | HandoffProof}``.
On the decode role the proof carries prefill's outcome, reserved vs transferred tokens and the
checks that ran, so the gateway can audit every answer without seeing its content; a body with
several choices carries the first proof that does not hold, else the first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from backend.core.errors import InvalidRequest, KvguardError
from backend.core.grammar import GrammarViolation
from backend.core.request import FinishReason, RequestState, SamplingParams
from backend.engine.async_engine import EngineEvent, Generation
from backend.server import formatting as fmt
from backend.server.encoding import JsonAnswer
from backend.server.errors import InternalEngineError, error_body
from backend.server.openai_schema import _SamplingFields
from backend.server.service import EngineService
from backend.server.structured import TEXT, OutputPlan, Pieces, Shaper
from backend.server.textstream import TextStream
from contracts.engine import REQUEST_ID_HEADER, TENANT_HEADER, HandoffProof, answer_extension

_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
DEFAULT_TENANT = "anonymous"
log = logging.getLogger("kvguard.engine")


@dataclass(slots=True)
class _Tally:
    completion_tokens: int = 0
    finish_reason: str = "length"
    error: KvguardError | None = None
    proof: HandoffProof | None = None
    tokens: list[fmt.TokenInfo] | None = None  # logprobs, when asked for


@dataclass(slots=True)
class _Choice:
    """One of the ``n`` choices: its engine request, text stream and outcome."""

    index: int
    generation: Generation
    stream: TextStream
    shaper: Shaper
    tally: _Tally
    text_offset: int = 0  # characters of token text so far (completions' text_offset)


@dataclass(frozen=True, slots=True)
class _Piece:
    """What one engine event adds to a choice: released text, its tokens' logprobs, and tool-call
    deltas."""

    text: str
    tokens: list[fmt.TokenInfo] | None
    calls: list[dict[str, Any]] = field(default_factory=list)


def _header_id(request: Request, header: str, default: str) -> str:
    value = request.headers.get(header)
    if value is None:
        return default
    if not _ID_PATTERN.match(value):
        raise InvalidRequest(header, "must be 1-128 characters of [A-Za-z0-9_.:-]")
    return value


async def generate(
    service: EngineService,
    http: Request,
    body: _SamplingFields,
    prompt: str,
    kind: fmt.Kind,
    plan: OutputPlan = TEXT,
) -> Response:
    tenant = _header_id(http, TENANT_HEADER, DEFAULT_TENANT)
    request_id = _header_id(http, REQUEST_ID_HEADER, f"req-{uuid.uuid4().hex}")
    if plan.grammar is not None:
        if body.stop_list():
            raise InvalidRequest("stop", "a constrained answer takes no stop sequences")
        await asyncio.to_thread(service.compile_grammar, plan.grammar, tenant)
    prompt_ids = service.encode_prompt(prompt, chat=kind == "chat")
    sampling = _sampling(service, body, len(prompt_ids), plan)
    choices = _submit(service, body, request_id, tenant, prompt_ids, sampling, plan)
    service.metrics.prompt_tokens.inc(len(prompt_ids))
    meta = fmt.ResponseMeta.new(kind, request_id, service.model_name)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _sse(service, choices, meta, len(prompt_ids), include_usage)
        return StreamingResponse(events, media_type="text/event-stream")
    return await _collect(service, http, choices, meta, len(prompt_ids))


def _sampling(
    service: EngineService, body: _SamplingFields, prompt_tokens: int, plan: OutputPlan
) -> SamplingParams:
    max_tokens = body.requested_max_tokens()
    if max_tokens is None:  # as much as fits (admission refuses a prompt that leaves no room)
        max_tokens = max(1, service.capacity().max_request_tokens - prompt_tokens)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop_token_ids=tuple(sorted(service.tokenizer.stop_ids)),
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=body.bias_items(service.tokenizer.vocab_size),
        logprobs=body.top_logprobs_count(),
        grammar=plan.grammar,
    )


def _submit(
    service: EngineService,
    body: _SamplingFields,
    request_id: str,
    tenant: str,
    prompt_ids: list[int],
    sampling: SamplingParams,
    plan: OutputPlan,
) -> list[_Choice]:
    choices: list[_Choice] = []
    kept = service.kept_specials(plan)
    try:
        for index in range(body.n):
            params = sampling
            if index and sampling.seed is not None:
                params = dataclasses.replace(sampling, seed=(sampling.seed + index) % 2**63)
            generation = service.submit(
                request_id=request_id if body.n == 1 else f"{request_id}.{index}",
                tenant=tenant,
                prompt_ids=prompt_ids,
                sampling=params,
            )
            decoder = service.tokenizer.stream_decoder(prompt_ids)
            stream = TextStream(decoder, body.stop_list(), kept)
            shaper = Shaper(plan, generation.request_id)
            tally = _Tally(tokens=None if sampling.logprobs is None else [])
            choices.append(_Choice(index, generation, stream, shaper, tally))
    except KvguardError as error:
        for choice in choices:
            choice.generation.abort()
        service.metrics.rejections.labels(error.code).inc()
        raise
    return choices


async def _consume(service: EngineService, choice: _Choice) -> AsyncIterator[_Piece]:
    """One choice's pieces; fills its tally with the outcome. Aborts it on early exit."""
    started = time.monotonic()
    tally = choice.tally
    try:
        async with asyncio.timeout(service.request_timeout_s):
            async for event in choice.generation.events():
                piece = _apply(service, event, choice, started)
                if piece.text or piece.tokens or piece.calls:
                    yield piece
                if choice.stream.stopped and not event.is_terminal:
                    choice.generation.abort()
                    last = _finish(choice, "stop")
                    if last.content or last.calls:
                        yield _Piece(last.content, None, last.calls)
                    return
    except TimeoutError:
        choice.generation.abort()
        tally.error = RequestTimedOut(service.request_timeout_s)
    except Exception:
        # A bug between the engine and the client (detokenizer, stop matching): the choice ends
        # as a failed one, never as a cut stream or a truncated answer that looks finished.
        log.exception("request %s failed while its answer was built", choice.generation.request_id)
        choice.generation.abort()
        tally.error = InternalEngineError()
    finally:
        service.metrics.requests.labels(_outcome(tally)).inc()


def _apply(service: EngineService, event: EngineEvent, choice: _Choice, started: float) -> _Piece:
    tally, text = choice.tally, []
    tokens: list[fmt.TokenInfo] | None = None
    if event.proof is not None:
        tally.proof = event.proof
    if event.token is not None:
        if tally.completion_tokens == 0:
            service.metrics.ttft_seconds.observe(time.monotonic() - started)
        tally.completion_tokens += 1
        if event.token not in service.tokenizer.stop_ids:
            text.append(choice.stream.push(event.token).text)
            if event.logprobs is not None:
                tokens = [fmt.token_info(event.token, event.logprobs, _token_text(service))]
    ended = None
    if event.is_terminal:
        if event.error is not None or event.state is not RequestState.FINISHED:
            tally.error = event.error or RequestAborted()
        else:
            stopped = event.finish_reason is FinishReason.STOP or choice.stream.stopped
            ended = "stop" if stopped else "length"
            text.append(choice.stream.finish())
    if tokens is not None and tally.tokens is not None:
        tally.tokens += tokens
    pieces = choice.shaper.push("".join(text))
    if ended is not None:
        pieces.add(_finish(choice, ended))
    return _Piece(pieces.content, tokens, pieces.calls)


def _finish(choice: _Choice, reason: str) -> Pieces:
    """The choice's last pieces and its finish reason, as its shaper decides them."""
    try:
        pieces, choice.tally.finish_reason = choice.shaper.finish(reason)
    except GrammarViolation as error:
        log.error("request %s: %s", choice.generation.request_id, error)
        choice.tally.error = error
        return Pieces()
    return pieces


def _token_text(service: EngineService) -> fmt.TokenText:
    tokenizer = service.tokenizer

    def token_text(token: int) -> tuple[str, tuple[int, ...]]:
        # the raw bytes: a lone byte of a multi-byte character is that byte, not U+FFFD's
        return tokenizer.token_text(token), tuple(tokenizer.token_bytes(token))

    return token_text


def _outcome(tally: _Tally) -> str:
    if tally.error is None:
        return "finished"
    return tally.error.code


async def _merged(
    service: EngineService, choices: Sequence[_Choice]
) -> AsyncIterator[tuple[_Choice, _Piece | None]]:
    """Every choice's pieces as they come, and ``(choice, None)`` when a choice has ended.
    Leaving early stops (and so aborts) the choices still running."""
    if len(choices) == 1:
        async for piece in _consume(service, choices[0]):
            yield choices[0], piece
        yield choices[0], None
        return
    queue: asyncio.Queue[tuple[_Choice, _Piece | None]] = asyncio.Queue()

    async def pump(choice: _Choice) -> None:
        try:
            async for piece in _consume(service, choice):
                queue.put_nowait((choice, piece))
        finally:
            queue.put_nowait((choice, None))

    tasks = [asyncio.ensure_future(pump(choice)) for choice in choices]
    try:
        running = len(choices)
        while running:
            item = await queue.get()
            running -= item[1] is None
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _piece_logprobs(kind: fmt.Kind, choice: _Choice, piece: _Piece) -> Any:
    body = fmt.logprobs_body(kind, piece.tokens, choice.text_offset)
    choice.text_offset += sum(len(t.text) for t in piece.tokens or ())
    return body


async def _sse(
    service: EngineService,
    choices: Sequence[_Choice],
    meta: fmt.ResponseMeta,
    prompt_tokens: int,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    for choice in choices:
        yield fmt.sse(fmt.chunk(meta, None, index=choice.index, first=True))
    async for choice, piece in _merged(service, choices):
        tally = choice.tally
        if piece is not None:
            logprobs = _piece_logprobs(meta.kind, choice, piece)
            chunk = fmt.chunk(
                meta, piece.text, index=choice.index, logprobs=logprobs, tool_calls=piece.calls
            )
            yield fmt.sse(chunk)
        elif tally.error is not None:
            error = error_body(str(tally.error), code=tally.error.code, type_="server_error")
            yield fmt.sse({**error, **_extension(service, [tally])})
            yield fmt.sse("[DONE]")
            return
        else:
            last = fmt.chunk(meta, None, tally.finish_reason, index=choice.index)
            yield fmt.sse({**last, **_extension(service, [tally])})
    if include_usage:
        completion = sum(c.tally.completion_tokens for c in choices)
        usage = fmt.usage_chunk(meta, fmt.usage(prompt_tokens, completion))
        yield fmt.sse({**usage, **_extension(service, [c.tally for c in choices])})
    yield fmt.sse("[DONE]")


async def _collect(
    service: EngineService,
    http: Request,
    choices: Sequence[_Choice],
    meta: fmt.ResponseMeta,
    prompt_tokens: int,
) -> Response:
    async def drain() -> None:
        async for choice, piece in _merged(service, choices):
            if piece is None and choice.tally.error is not None:
                return

    task = asyncio.ensure_future(drain())
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await http.is_disconnected():
            task.cancel()
            for choice in choices:
                choice.generation.abort()
            return Response(status_code=499)
    task.result()
    tallies = [c.tally for c in choices]
    extension = _extension(service, tallies)
    failed = next((t for t in tallies if t.error is not None), None)
    if failed is not None and failed.error is not None:
        error = failed.error
        type_ = "invalid_request_error" if error.http_status < 500 else "server_error"
        body = {**error_body(str(error), code=error.code, type_=type_), **extension}
        return JsonAnswer(body, status_code=error.http_status)
    results = []
    for c in choices:
        content, calls = c.shaper.result(c.tally.finish_reason)
        results.append(
            fmt.ChoiceResult(c.index, content, c.tally.finish_reason, c.tally.tokens, calls)
        )
    usage = fmt.usage(prompt_tokens, sum(t.completion_tokens for t in tallies))
    return JsonAnswer({**fmt.full_response(meta, results, usage), **extension})


def _extension(service: EngineService, tallies: Sequence[_Tally]) -> dict[str, Any]:
    proofs = [t.proof for t in tallies if t.proof is not None]
    broken = [p for p in proofs if not p.consistent]
    chosen = broken or proofs
    return answer_extension(service.role.value, chosen[0] if chosen else None)


class RequestAborted(KvguardError):
    code = "request_aborted"
    http_status = 503

    def __init__(self) -> None:
        super().__init__("the request was aborted before it finished")


class RequestTimedOut(KvguardError):
    code = "request_timeout"
    http_status = 504

    def __init__(self, seconds: float) -> None:
        super().__init__(f"the request did not finish within {seconds:.0f} s", seconds)
