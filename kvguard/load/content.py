"""The content checks of one load-run response: what a status-code-only load test never looks at.

Lifecycle of one check: the Locust user reads a streamed answer into a ``StreamedAnswer`` (status,
error code, assembled text, stream error events, usage, finish reason) with ``read_sse`` fed line
by line -> ``check_answer(expected, answer)`` -> a ``Verdict`` whose ``failures`` name every
broken expectation as ``(kind, reason)``. Kinds: ``status`` (the HTTP status or error code is not
the one this request's size calls for) and ``content`` (own marker missing, another marker
present, usage inconsistent, a stream cut by an error event).

Markers: the own marker must come back whole (``MARKER_RE``); any other marker piece
(``MARKER_PIECE_RE``: ``CNRY-`` and at least ``MIN_PIECE_CHARS`` base32 characters, a cut-off copy
included) that is not the start of the own marker is a foreign marker (``foreign_markers``): a
partial copy of another request's marker is already a leak. Limit: a piece short enough to also be
the start of the own marker (the first characters are the tenant tag, shared by one tenant's
markers) cannot be told apart from it and is not counted.

Reasons never quote the answer or a marker (a leaked marker is someone's secret): they say what
was wrong, not what was seen. Pure: no I/O, no Locust, no HTTP.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from canary.markers import BASE32_CLASS, BODY_CHARS, PREFIX

MIN_PIECE_CHARS = 4
MARKER_RE = re.compile(re.escape(PREFIX) + BASE32_CLASS + "{" + str(BODY_CHARS) + "}")
MARKER_PIECE_RE = re.compile(
    re.escape(PREFIX) + BASE32_CLASS + "{" + str(MIN_PIECE_CHARS) + "," + str(BODY_CHARS) + "}"
)
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
FOREIGN_CANARY_MARKER = "foreign_canary_marker"


class FailureKind(StrEnum):
    STATUS = "status"
    CONTENT = "content"


@dataclass(frozen=True, slots=True)
class Expected:
    """What a correct answer to one load request looks like."""

    status: int
    marker: str = field(repr=False)
    max_tokens: int
    code: str | None = None
    prompt_tokens: int | None = None
    prompt_slack: int = 0
    byte_tokens: bool = False


@dataclass(slots=True)
class StreamedAnswer:
    """One answer as the client assembled it. ``text`` may hold markers: never logged."""

    status: int
    code: str | None = None
    text: str = field(default="", repr=False)
    stream_errors: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    content_chunks: int = 0
    done: bool = False


@dataclass(frozen=True, slots=True)
class Verdict:
    failures: tuple[tuple[FailureKind, str], ...] = ()

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def kinds(self) -> frozenset[FailureKind]:
        return frozenset(kind for kind, _ in self.failures)

    def reason(self) -> str:
        return "; ".join(f"{kind.value}: {reason}" for kind, reason in self.failures)


def error_code(body: bytes | str) -> str | None:
    """The ``error.code`` of an OpenAI-style error body, if it has one."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


class SseLines:
    """Splits a byte stream into text lines as chunks arrive (UTF-8 split anywhere is fine)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._rest = ""

    def feed(self, chunk: bytes) -> list[str]:
        text = self._rest + self._decoder.decode(chunk)
        *lines, self._rest = text.split("\n")
        return [line.rstrip("\r") for line in lines]


def read_sse_line(answer: StreamedAnswer, line: str) -> bool:
    """Fold one SSE line into ``answer``; True when it carried new content text."""
    if not line.startswith("data:"):
        return False
    data = line[5:].strip()
    if data == "[DONE]":
        answer.done = True
        return False
    try:
        event = json.loads(data)
    except ValueError:
        answer.stream_errors.append("malformed_event")
        return False
    if not isinstance(event, dict):
        answer.stream_errors.append("malformed_event")
        return False
    if "error" in event:
        answer.stream_errors.append(error_code(data) or "error")
        return False
    if isinstance(event.get("usage"), dict):
        answer.usage = event["usage"]
    grew = False
    for choice in event.get("choices") or []:
        piece = (choice.get("delta") or {}).get("content")
        if piece:
            answer.text += piece
            grew = True
        if choice.get("finish_reason"):
            answer.finish_reason = choice["finish_reason"]
    if grew:
        answer.content_chunks += 1
    return grew


def check_answer(expected: Expected, answer: StreamedAnswer) -> Verdict:
    failures: list[tuple[FailureKind, str]] = []
    if answer.status != expected.status or answer.code != expected.code:
        want = f"{expected.status}{' ' + expected.code if expected.code else ''}"
        got = f"{answer.status}{' ' + answer.code if answer.code else ''}"
        failures.append((FailureKind.STATUS, f"expected {want}, got {got}"))
        return Verdict(tuple(failures))
    if expected.status != 200:
        return Verdict()
    failures += [(FailureKind.CONTENT, r) for r in _stream_problems(answer)]
    failures += [(FailureKind.CONTENT, r) for r in _marker_problems(expected, answer.text)]
    failures += [(FailureKind.CONTENT, r) for r in _usage_problems(expected, answer)]
    return Verdict(tuple(failures))


def _stream_problems(answer: StreamedAnswer) -> list[str]:
    problems = [f"stream ended with error event {code}" for code in answer.stream_errors]
    if not answer.done and not answer.stream_errors:
        problems.append("stream ended without [DONE]")
    return problems


def foreign_markers(text: str, own: str) -> int:
    """How many marker pieces in ``text``, whole or cut off, are not the start of ``own``."""
    return sum(1 for piece in MARKER_PIECE_RE.findall(text) if not own.startswith(piece))


def _marker_problems(expected: Expected, text: str) -> list[str]:
    problems = []
    if expected.marker not in MARKER_RE.findall(text):
        problems.append("own marker missing")
    others = foreign_markers(text, expected.marker)
    if others:
        problems.append(f"{others} foreign marker(s) in the answer")
    return problems


def _usage_problems(expected: Expected, answer: StreamedAnswer) -> list[str]:
    usage = answer.usage
    if usage is None:
        return ["no usage in the stream"]
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return ["usage without integer prompt_tokens/completion_tokens"]
    problems = []
    if prompt <= 0:
        problems.append(f"usage.prompt_tokens {prompt} <= 0")
    elif expected.prompt_tokens is not None and (
        abs(prompt - expected.prompt_tokens) > expected.prompt_slack
    ):
        problems.append(f"usage.prompt_tokens {prompt}, sent {expected.prompt_tokens}")
    if usage.get("total_tokens") not in (None, prompt + completion):
        problems.append("usage.total_tokens != prompt_tokens + completion_tokens")
    problems += _completion_problems(expected, answer, completion)
    return problems


def _completion_problems(expected: Expected, answer: StreamedAnswer, completion: int) -> list[str]:
    if completion > expected.max_tokens:
        return [f"usage.completion_tokens {completion} > max_tokens {expected.max_tokens}"]
    if answer.text and completion < 1:
        return ["content streamed but usage.completion_tokens is 0"]
    if answer.finish_reason == "length" and completion != expected.max_tokens:
        return [f"finish_reason length at {completion} of max_tokens {expected.max_tokens}"]
    if expected.byte_tokens:
        # A byte-level tokenizer: one token per byte streamed, plus the end-of-sequence token
        # that a "stop" finish counts and does not stream.
        streamed = len(answer.text.encode("utf-8"))
        if not streamed <= completion <= streamed + 1:
            return [f"usage.completion_tokens {completion} for {streamed} streamed bytes"]
    return []
