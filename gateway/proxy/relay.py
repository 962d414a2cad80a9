"""Relaying an engine's answer to the client through the response guard, event by event.

``StreamRelay`` turns each upstream SSE event into the bytes the client gets (pure: no I/O):

- keep-alives, comments and ``[DONE]`` pass as they are;
- a chunk whose text the guard lets through unchanged passes byte for byte; a changed text
  (held back or released) is re-serialised with only that text replaced;
- the guard is finished on the chunk carrying ``finish_reason`` (its held-back tail joins that
  chunk), or at ``[DONE]`` as a chunk of its own;
- a ``Cut`` becomes an OpenAI-style error event and ends the stream;
- the usage-only chunk (which the gateway always asks for) reaches the client only if the client
  asked for it; usage and the handoff proof are recorded from it;
- an upstream error event passes through and ends the stream as failed; a stream that ends
  without ``[DONE]`` gets an error event (never a silently truncated 200).

``relay_body`` does the same for a non-streaming answer.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import error_body
from gateway.hooks import Cut, Emit, StreamGuard
from gateway.lifecycle import Phase
from gateway.proxy.context import HandoffProof, parse_handoff
from gateway.upstream.base import Endpoint
from gateway.upstream.sse import DONE, encode_event, event_data


def error_event(message: str, code: str, type_: str = "server_error") -> bytes:
    return encode_event(error_body(message, code=code, type_=type_))


def cut_event(cut: Cut) -> bytes:
    return error_event(cut.message, cut.code)


@dataclass(slots=True)
class Step:
    """What to send for one upstream event, and the terminal phase if the stream ends here."""

    out: list[bytes]
    end: Phase | None = None
    code: str | None = None


@dataclass(slots=True)
class StreamRelay:
    endpoint: Endpoint
    guard: StreamGuard
    wants_usage: bool
    refuse_handoff_mismatch: bool = True
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    handoff: HandoffProof | None = None
    cut: Cut | None = None
    _finished_guard: bool = False
    _template: dict[str, Any] | None = field(default=None, repr=False)

    def on_event(self, raw: bytes) -> Step:
        data = event_data(raw)
        if data is None:
            return Step([raw])
        if data.strip() == DONE:
            return self._on_done(raw)
        try:
            obj = json.loads(data)
        except ValueError:
            obj = None
        if not isinstance(obj, dict):
            return Step(
                [error_event("the engine sent an invalid event", "upstream_error")],
                Phase.FAILED,
                "upstream_error",
            )
        if "error" in obj:
            return Step([raw], Phase.FAILED, _error_code(obj))
        self._note(obj)
        mismatch = self.handoff is not None and not self.handoff.consistent
        if mismatch and self.refuse_handoff_mismatch:
            message = "the engine could not prove this answer's KV belongs to this request"
            return Step(
                [error_event(message, "handoff_mismatch")], Phase.FAILED, "handoff_mismatch"
            )
        choices = obj.get("choices")
        if not choices:
            return Step([raw] if self.wants_usage or "usage" not in obj else [])
        return self._on_chunk(raw, obj)

    def on_upstream_end(self) -> Step:
        return Step(
            [error_event("the engine ended the stream early", "upstream_error")],
            Phase.FAILED,
            "upstream_error",
        )

    def _note(self, obj: dict[str, Any]) -> None:
        usage = obj.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                self.completion_tokens = usage["completion_tokens"]
            if isinstance(usage.get("prompt_tokens"), int):
                self.prompt_tokens = usage["prompt_tokens"]
        self.handoff = parse_handoff(obj) or self.handoff

    def _on_chunk(self, raw: bytes, obj: dict[str, Any]) -> Step:
        choice = obj["choices"][0] if isinstance(obj["choices"][0], dict) else {}
        self._template = obj
        text = _chunk_text(self.endpoint, choice)
        verdict: Emit | Cut = self.guard.feed(text) if text else Emit("")
        if isinstance(verdict, Emit) and choice.get("finish_reason") is not None:
            verdict = self._join(verdict, self._finish_guard())
        if isinstance(verdict, Cut):
            self.cut = verdict
            return Step([cut_event(verdict)], Phase.CUT, verdict.code)
        if verdict.text == text:
            return Step([raw])
        if not verdict.text and not choice.get("finish_reason") and "usage" not in obj:
            return Step([])  # everything held back: nothing to send yet
        return Step([encode_event(_with_text(self.endpoint, obj, verdict.text))])

    def _on_done(self, raw: bytes) -> Step:
        tail = self._finish_guard()
        if isinstance(tail, Cut):
            self.cut = tail
            return Step([cut_event(tail)], Phase.CUT, tail.code)
        out = []
        if tail.text and self._template is not None:
            chunk = _with_text(self.endpoint, self._template, tail.text)
            chunk["choices"][0]["finish_reason"] = None
            chunk.pop("usage", None)
            out.append(encode_event(chunk))
        return Step([*out, raw], Phase.COMPLETED)

    def _finish_guard(self) -> Emit | Cut:
        if self._finished_guard:
            return Emit("")
        self._finished_guard = True
        return self.guard.finish()

    @staticmethod
    def _join(first: Emit, second: Emit | Cut) -> Emit | Cut:
        return second if isinstance(second, Cut) else Emit(first.text + second.text)


def relay_body(
    endpoint: Endpoint, body: dict[str, Any], guard: StreamGuard
) -> dict[str, Any] | Cut:
    """A non-streaming answer through the guard: the body (text replaced if changed) or a Cut."""
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return body
    choice = choices[0]
    text = _message_text(endpoint, choice)
    first = guard.feed(text) if text else Emit("")
    if isinstance(first, Cut):
        return first
    rest = guard.finish()
    if isinstance(rest, Cut):
        return rest
    released = first.text + rest.text
    if released == text:
        return body
    changed = copy.deepcopy(body)
    if endpoint is Endpoint.CHAT:
        changed["choices"][0].setdefault("message", {})["content"] = released
    else:
        changed["choices"][0]["text"] = released
    return changed


def _chunk_text(endpoint: Endpoint, choice: dict[str, Any]) -> str:
    if endpoint is Endpoint.CHAT:
        delta = choice.get("delta")
        content = delta.get("content") if isinstance(delta, dict) else None
    else:
        content = choice.get("text")
    return content if isinstance(content, str) else ""


def _message_text(endpoint: Endpoint, choice: dict[str, Any]) -> str:
    if endpoint is Endpoint.CHAT:
        message = choice.get("message")
        content = message.get("content") if isinstance(message, dict) else None
    else:
        content = choice.get("text")
    return content if isinstance(content, str) else ""


def _with_text(endpoint: Endpoint, obj: dict[str, Any], text: str) -> dict[str, Any]:
    chunk = copy.deepcopy(obj)
    choice = chunk["choices"][0]
    if endpoint is Endpoint.CHAT:
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        choice["delta"] = {**delta, "content": text}
    else:
        choice["text"] = text
    return chunk


def _error_code(obj: dict[str, Any]) -> str:
    error = obj.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else "upstream_error"
