"""OpenAI response bodies and stream chunks (completion and chat flavours), as OpenAI's published
schemas describe them: a chat answer's choices carry ``logprobs`` and ``message.refusal`` (null
when absent); chat ids start ``chatcmpl-``, completion ids ``cmpl-``.

A chat answer's tool calls are ``message.tool_calls`` (``content`` null when there is no other
text); streamed, ``delta.tool_calls`` items carry their ``index`` (``backend.server.structured``).

Logprobs come in two shapes: chat's ``{"content": [{token, logprob, bytes, top_logprobs}],
"refusal": null}`` and the completions API's parallel lists (``tokens``, ``token_logprobs``,
``top_logprobs`` as ``{token: logprob}``, ``text_offset``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from backend.core.messages import TokenLogprobs
from backend.server.encoding import dumps

Kind = Literal["text", "chat"]
ID_PREFIX: dict[Kind, str] = {"chat": "chatcmpl-", "text": "cmpl-"}


@dataclass(frozen=True, slots=True)
class TokenInfo:
    """One generated token as logprobs show it: its text, bytes and logprobs."""

    text: str = field(repr=False)
    bytes_: tuple[int, ...] = field(repr=False)
    logprobs: TokenLogprobs = field(repr=False)
    top: tuple[tuple[str, tuple[int, ...], float], ...] = field(repr=False)


TokenText = Callable[[int], tuple[str, tuple[int, ...]]]  # token id -> (text, bytes)


def token_info(token: int, logprobs: TokenLogprobs, token_text: TokenText) -> TokenInfo:
    text, raw = token_text(token)
    top = tuple((*token_text(alt), lp) for alt, lp in logprobs.top)
    return TokenInfo(text, raw, logprobs, top)


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    kind: Kind
    response_id: str
    model: str
    created: int

    @classmethod
    def new(cls, kind: Kind, request_id: str, model: str) -> ResponseMeta:
        return cls(kind, ID_PREFIX[kind] + request_id, model, int(time.time()))

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        obj = {
            ("text", False): "text_completion",
            ("text", True): "text_completion",
            ("chat", False): "chat.completion",
            ("chat", True): "chat.completion.chunk",
        }[(self.kind, chunk)]
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}


@dataclass(slots=True)
class ChoiceResult:
    """One finished choice of a non-streaming answer."""

    index: int
    text: str | None  # chat: None when the answer is only tool calls
    finish_reason: str
    tokens: list[TokenInfo] | None  # None: logprobs were not asked for
    tool_calls: list[dict[str, Any]] | None = None  # chat: the answer's calls, if any


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def logprobs_body(kind: Kind, tokens: Sequence[TokenInfo] | None, offset: int = 0) -> Any:
    """The ``logprobs`` of a choice (or a chunk of it); ``offset``: the completion text's length
    before these tokens (completions' ``text_offset``)."""
    if tokens is None:
        return None
    if kind == "chat":
        content = [
            {
                "token": t.text,
                "logprob": t.logprobs.logprob,
                "bytes": list(t.bytes_),
                "top_logprobs": [
                    {"token": text, "logprob": lp, "bytes": list(raw)} for text, raw, lp in t.top
                ],
            }
            for t in tokens
        ]
        return {"content": content, "refusal": None}
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    return {
        "tokens": [t.text for t in tokens],
        "token_logprobs": [t.logprobs.logprob for t in tokens],
        "top_logprobs": [{text: lp for text, _, lp in t.top} for t in tokens],
        "text_offset": offsets,
    }


def full_response(
    meta: ResponseMeta, choices: Sequence[ChoiceResult], usage_: dict[str, int]
) -> dict[str, Any]:
    body = meta._envelope(chunk=False)
    out = []
    for c in choices:
        if meta.kind == "chat":
            message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
            if c.tool_calls:
                message["tool_calls"] = c.tool_calls
            choice: dict[str, Any] = {"index": c.index, "message": message}
        else:
            choice = {"index": c.index, "text": c.text}
        choice["logprobs"] = logprobs_body(meta.kind, c.tokens)
        choice["finish_reason"] = c.finish_reason
        out.append(choice)
    body["choices"] = out
    body["usage"] = usage_
    return body


def chunk(
    meta: ResponseMeta,
    text: str | None,
    finish_reason: str | None = None,
    *,
    index: int = 0,
    first: bool = False,
    logprobs: Any = None,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    body = meta._envelope(chunk=True)
    if meta.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = tool_calls
        choice: dict[str, Any] = {"index": index, "delta": delta}
    else:
        choice = {"index": index, "text": text or ""}
    choice["logprobs"] = logprobs
    choice["finish_reason"] = finish_reason
    body["choices"] = [choice]
    return body


def usage_chunk(meta: ResponseMeta, usage_: dict[str, int]) -> dict[str, Any]:
    body = meta._envelope(chunk=True)
    body["choices"] = []
    body["usage"] = usage_
    return body


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload.encode() if isinstance(payload, str) else dumps(payload)
    return b"data: " + data + b"\n\n"
