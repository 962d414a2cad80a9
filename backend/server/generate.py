"""One OpenAI request through the engine: validate -> submit -> stream or collect.

Admission happens in ``submit`` before any response byte is sent, so an over-long request is a
plain 400 even when the client asked for a stream. After that, a stream ends in exactly one way:
its finish chunk (plus usage when asked) and ``[DONE]``, or an error event and ``[DONE]``. A client
that goes away aborts the request, which releases its pages.

Every response says how its KV came to be in a ``kvguard`` extension field (the non-streaming body,
the error body, and the final stream chunks): ``{"role": ..., "handoff": null | HandoffProof}``.
On the decode role the proof carries prefill's outcome, reserved vs transferred tokens and the
checks that ran, so the gateway can audit every answer without seeing its content.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from backend.core.errors import InvalidRequest, KvguardError
from backend.core.request import FinishReason, RequestState, SamplingParams
from backend.disagg.machines import HandoffProof
from backend.engine.async_engine import EngineEvent, Generation
from backend.server import formatting as fmt
from backend.server.errors import error_body
from backend.server.openai_schema import _SamplingFields
from backend.server.schema import REQUEST_ID_HEADER, TENANT_HEADER
from backend.server.service import EngineService
from backend.server.textstream import TextStream

_ID_PATTERN = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
DEFAULT_TENANT = "anonymous"


@dataclass(slots=True)
class _Tally:
    text: list[str]
    completion_tokens: int = 0
    finish_reason: str = "length"
    error: KvguardError | None = None
    proof: HandoffProof | None = None


def _header_id(request: Request, header: str, default: str) -> str:
    value = request.headers.get(header)
    if value is None:
        return default
    if not _ID_PATTERN.match(value):
        raise InvalidRequest(header, "must be 1-128 characters of [A-Za-z0-9_.:-]")
    return value


async def generate(
    service: EngineService, http: Request, body: _SamplingFields, prompt: str, kind: fmt.Kind
) -> Response:
    tenant = _header_id(http, TENANT_HEADER, DEFAULT_TENANT)
    request_id = _header_id(http, REQUEST_ID_HEADER, f"req-{uuid.uuid4().hex}")
    prompt_ids = service.encode_prompt(prompt)
    sampling = SamplingParams(
        max_tokens=body.max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop_token_ids=tuple(sorted(service.tokenizer.stop_ids)),
    )
    try:
        generation = service.submit(
            request_id=request_id, tenant=tenant, prompt_ids=prompt_ids, sampling=sampling
        )
    except KvguardError as error:
        service.metrics.rejections.labels(error.code).inc()
        raise
    service.metrics.prompt_tokens.inc(len(prompt_ids))
    meta = fmt.ResponseMeta.new(kind, f"cmpl-{request_id}", service.model_name)
    stream = TextStream(service.tokenizer.stream_decoder(), body.stop_list())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _sse(service, generation, stream, meta, len(prompt_ids), include_usage)
        return StreamingResponse(events, media_type="text/event-stream")
    return await _collect(service, http, generation, stream, meta, len(prompt_ids))


async def _consume(
    service: EngineService, generation: Generation, stream: TextStream, tally: _Tally
) -> AsyncIterator[str]:
    """Yields text deltas; fills ``tally`` with the outcome. Aborts the request on early exit."""
    started = time.monotonic()
    try:
        async with asyncio.timeout(service.request_timeout_s):
            async for event in generation.events():
                for text in _apply(service, event, stream, tally, started):
                    yield text
                if stream.stopped:
                    generation.abort()
                    tally.finish_reason = "stop"
                    return
    except TimeoutError:
        generation.abort()
        tally.error = RequestTimedOut(service.request_timeout_s)
    finally:
        service.metrics.requests.labels(_outcome(tally)).inc()


def _apply(
    service: EngineService, event: EngineEvent, stream: TextStream, tally: _Tally, started: float
) -> list[str]:
    out: list[str] = []
    if event.proof is not None:
        tally.proof = event.proof
    if event.token is not None:
        if tally.completion_tokens == 0:
            service.metrics.ttft_seconds.observe(time.monotonic() - started)
        tally.completion_tokens += 1
        if event.token not in service.tokenizer.stop_ids:
            delta = stream.push(event.token)
            if delta.text:
                out.append(delta.text)
    if event.is_terminal:
        if event.error is not None or event.state is not RequestState.FINISHED:
            tally.error = event.error or RequestAborted()
        else:
            tally.finish_reason = "stop" if event.finish_reason is FinishReason.STOP else "length"
            tail = stream.finish()
            if tail:
                out.append(tail)
    return out


def _outcome(tally: _Tally) -> str:
    if tally.error is None:
        return "finished"
    return tally.error.code


async def _sse(
    service: EngineService,
    generation: Generation,
    stream: TextStream,
    meta: fmt.ResponseMeta,
    prompt_tokens: int,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    tally = _Tally(text=[])
    yield fmt.sse(fmt.chunk(meta, None, first=True))
    async for text in _consume(service, generation, stream, tally):
        yield fmt.sse(fmt.chunk(meta, text))
    extension = _extension(service, tally)
    if tally.error is not None:
        body = error_body(str(tally.error), code=tally.error.code, type_="server_error")
        yield fmt.sse({**body, **extension})
    else:
        yield fmt.sse({**fmt.chunk(meta, None, tally.finish_reason), **extension})
        if include_usage:
            usage = fmt.usage_chunk(meta, fmt.usage(prompt_tokens, tally.completion_tokens))
            yield fmt.sse({**usage, **extension})
    yield fmt.sse("[DONE]")


async def _collect(
    service: EngineService,
    http: Request,
    generation: Generation,
    stream: TextStream,
    meta: fmt.ResponseMeta,
    prompt_tokens: int,
) -> Response:
    tally = _Tally(text=[])

    async def drain() -> None:
        async for text in _consume(service, generation, stream, tally):
            tally.text.append(text)

    task = asyncio.ensure_future(drain())
    while not task.done():
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await http.is_disconnected():
            task.cancel()
            generation.abort()
            return Response(status_code=499)
    task.result()
    extension = _extension(service, tally)
    if tally.error is not None:
        error = tally.error
        type_ = "invalid_request_error" if error.http_status < 500 else "server_error"
        body = {**error_body(str(error), code=error.code, type_=type_), **extension}
        return JSONResponse(body, status_code=error.http_status)
    usage = fmt.usage(prompt_tokens, tally.completion_tokens)
    body = fmt.full_response(meta, "".join(tally.text), tally.finish_reason, usage)
    return JSONResponse({**body, **extension})


def _extension(service: EngineService, tally: _Tally) -> dict[str, Any]:
    handoff = tally.proof.as_dict() if tally.proof is not None else None
    return {"kvguard": {"role": service.role.value, "handoff": handoff}}


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
