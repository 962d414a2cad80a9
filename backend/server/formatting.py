"""OpenAI response bodies and stream chunks (completion and chat flavours)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["text", "chat"]


@dataclass(frozen=True, slots=True)
class ResponseMeta:
    kind: Kind
    response_id: str
    model: str
    created: int

    @classmethod
    def new(cls, kind: Kind, response_id: str, model: str) -> ResponseMeta:
        return cls(kind, response_id, model, int(time.time()))

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        obj = {
            ("text", False): "text_completion",
            ("text", True): "text_completion",
            ("chat", False): "chat.completion",
            ("chat", True): "chat.completion.chunk",
        }[(self.kind, chunk)]
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def full_response(
    meta: ResponseMeta, text: str, finish_reason: str, usage_: dict[str, int]
) -> dict[str, Any]:
    body = meta._envelope(chunk=False)
    if meta.kind == "chat":
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
    else:
        choice = {"index": 0, "text": text, "logprobs": None}
    choice["finish_reason"] = finish_reason
    body["choices"] = [choice]
    body["usage"] = usage_
    return body


def chunk(
    meta: ResponseMeta, text: str | None, finish_reason: str | None = None, *, first: bool = False
) -> dict[str, Any]:
    body = meta._envelope(chunk=True)
    if meta.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None}
    choice["finish_reason"] = finish_reason
    body["choices"] = [choice]
    return body


def usage_chunk(meta: ResponseMeta, usage_: dict[str, int]) -> dict[str, Any]:
    body = meta._envelope(chunk=True)
    body["choices"] = []
    body["usage"] = usage_
    return body


def sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
