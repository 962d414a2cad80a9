"""Relaying an engine's answer to the client through the response guards, event by event.

``StreamRelay`` turns each upstream SSE event into the bytes the client gets (pure: no I/O):

- keep-alives and comments become one canonical keep-alive (a comment is free text a client
  never reads, so nothing an engine writes there is passed on); ``[DONE]`` passes;
- every choice's text goes through its own guard (``open_guard()`` once per choice index, so a
  guard sees one text stream in order); a chunk whose texts all pass unchanged passes byte for
  byte (see below), a changed text (held back or released) is re-serialised with only the texts
  replaced;
- every other string of an event (ids, names, keys, error messages, extension fields) goes
  through the side guards (``gateway.proxy.side``), so a foreign marker an engine hides outside
  the text still never reaches the client complete; the side fields the model writes (reasoning,
  refusal, tool-call arguments, logprobs tokens) are rewritten like the text (the event is then
  re-serialised) and what their guards still hold goes out as one chunk before ``[DONE]``;
- a choice's guard is finished on the chunk carrying its ``finish_reason`` (its held-back tail
  joins that chunk), or at ``[DONE]`` as a chunk of its own;
- a ``Cut`` becomes an OpenAI-style error event and ends the stream;
- the usage-only chunk (which the gateway always asks for) reaches the client only if the client
  asked for it; usage and the handoff proof are recorded from it; every ``usage`` the client gets
  shows its own prompt (``own_usage``: a canary marker's tokens taken out);
- an event whose texts the guards hold back entirely still goes out (texts empty) when it carries
  anything else: a role, tool calls, logprobs, a finish;
- the engine's ``kvguard`` object (and a top-level ``handoff``) is recorded and taken out of every
  event; with a ``Disclosure`` (the gateway's requests) the last chunk before ``[DONE]`` carries
  the gateway's own (``gateway.proxy.disclosure``): the usage chunk the client asked for, held
  until then, else a chunk with no choices;
- an upstream error event (screened) goes out as its ``error`` alone, every address in it
  replaced, and ends the stream as failed; a stream that
  ends without ``[DONE]`` gets an error event (never a silently truncated 200), after every guard
  is finished for its verdict only (nothing held back is delivered): a marker cut short by an
  engine crash still cuts, with its findings, instead of vanishing with the held-back text;
- an event the gateway cannot vouch for (not JSON, too many choices, text after a choice
  finished) ends the stream as an upstream error;
- an event's own bytes go out only when they are one ``data:`` line holding exactly the JSON of
  what was read (orjson's compact form of the parsed event); any other event whose texts pass
  unchanged (SSE fields other than ``data``, several lines, CRLF) is written anew from what was
  screened. A key given twice is read as its last value (as JavaScript, Python, Go
  and Jackson read it), and the first value's bytes must not reach the client unread: a hostile
  reader of the raw stream would see them. An engine that writes each event as compact JSON on
  one line (the bundled engine's orjson; pydantic's ``model_dump_json``) keeps the byte-for-byte
  path; one that writes spaces after its separators has its events written anew;
- the usual token is not read in full: once a common chunk (one choice's text, nothing else to
  note) went out byte for byte with its side fields quiet, the bytes around its text are the
  stream's ``Frame``, and an event made of them around another plain JSON string is that chunk
  with another text: only the text goes through its guard (``gateway.proxy.frame``).

The shapes it reads and writes are in ``gateway.proxy.chunks``; a whole (non-streamed) answer
goes through the same guards in ``gateway.proxy.body``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from contracts.engine import EXTENSION, HandoffProof, handoff_of
from contracts.plugins import Cut, Emit, Prefilter, StreamGuard
from contracts.sse import DONE, encode_event, parse_event
from gateway.errors import HandoffMismatch, error_body
from gateway.lifecycle import Phase
from gateway.proxy.chunks import (
    CHUNK_OBJECT,
    MAX_CHOICES,
    InvalidUpstream,
    choice_index,
    chunk_text,
    fill_logprobs,
    more_than_text,
    own_usage,
    text_tail_chunk,
    token_count,
    with_texts,
)
from gateway.proxy.disclosure import Disclosure, scrubbed, without_engine_object
from gateway.proxy.frame import Frame
from gateway.proxy.side import SideScreen, tail_chunk
from gateway.proxy.side_fields import InvalidSide, skeleton, text_path
from gateway.upstream.base import Endpoint

KEEP_ALIVE = b": keep-alive\n\n"
OpenGuard = Callable[[], StreamGuard]


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
    """One stream's relay: ``relay_event`` appends what the client gets for an upstream event to
    the caller's list (no object per event) and says whether the stream ends there; ``end`` and
    ``end_code`` then say how."""

    endpoint: Endpoint
    open_guard: OpenGuard
    wants_usage: bool
    refuse_handoff_mismatch: bool = True
    screen_side: bool = True  # off only when the guards pass everything (no canary)
    side_prefilter: Prefilter | None = None
    hidden_prompt_tokens: int = 0  # what the hooks added: taken out of the usage the client sees
    disclosure: Disclosure | None = None  # the gateway's kvguard object goes in the final chunk
    completion_tokens: int | None = None
    prompt_tokens: int | None = None  # the engine's count (hooks' additions included)
    handoff: HandoffProof | None = None
    cut: Cut | None = None
    end: Phase | None = None  # set when the stream ends (COMPLETED, CUT, FAILED)
    end_code: str | None = None
    saw_text: bool = False
    text_events: int = 0  # events carrying any choice text (the token clock's ticks)
    finish_reasons: list[str] = field(default_factory=list)  # per choice, as the engine ended it
    _guards: dict[int, StreamGuard] = field(default_factory=dict, repr=False)
    _finished: set[int] = field(default_factory=set)
    _side: SideScreen | None = field(default=None, repr=False)
    _template: dict[str, Any] | None = field(default=None, repr=False)
    _usage_chunk: dict[str, Any] | None = field(default=None, repr=False)  # held for the end
    _chat: bool = False
    _frame: Frame | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._chat = self.endpoint is Endpoint.CHAT
        if self.screen_side:
            text = text_path(chat=self._chat, streamed=True)
            self._side = SideScreen(self.open_guard, text=text, prefilter=self.side_prefilter)

    def on_event(self, raw: bytes) -> Step:
        """One event's ``Step`` (a list and a step per event: for tests and benchmarks; the pump
        calls ``relay_event``)."""
        out: list[bytes] = []
        ended = self.relay_event(raw, out)
        return Step(out, self.end if ended else None, self.end_code if ended else None)

    def on_upstream_end(self) -> Step:
        out: list[bytes] = []
        self.relay_end(out)
        return Step(out, self.end, self.end_code)

    def relay_event(self, raw: bytes, out: list[bytes]) -> bool:
        """Relay one upstream event (its bytes with the blank line that ends it): append what the
        client gets to ``out``; True when the stream ends here (``end``, ``end_code``)."""
        frame = self._frame
        if frame is not None:
            text = frame.text_of(raw)
            if text is not None and frame.guard.passes(text):  # the usual token: as it came
                self.text_events += 1
                out.append(raw)
                return False
            self._frame = None  # anything else: read in full (the guard has not moved)
        if raw[:6] == b"data: " and raw.find(b"\n", 6) == len(raw) - 2 and b"\r" not in raw:
            data: str | None = raw[6:-2].decode("utf-8", errors="replace")  # the usual event
            canonical = True
        else:
            data, canonical = parse_event(raw)
        if data is None:
            out.append(KEEP_ALIVE)
            return False
        if data == DONE or data.strip() == DONE:
            return self._on_done(raw if canonical else encode_event(DONE), out)
        try:
            obj = orjson.loads(data)  # ``parse_json``'s first reader, without the call
        except orjson.JSONDecodeError:
            try:
                obj = parse_json(data)
            except ValueError:
                obj = None
        if not isinstance(obj, dict):
            return self.invalid(out)
        # The event's own bytes may go out only when they are what was read: the JSON of ``obj``
        # (a key given twice is read as its last value, and the first must not go out unread;
        # an integer past 64 bits orjson cannot write).
        if canonical and raw[:6] == b"data: ":
            try:
                canonical = orjson.dumps(obj) == raw[6:-2]
            except orjson.JSONEncodeError:
                canonical = False
        side = self._side
        shape = None
        # most events: no guard holds text back and the prefilter clears them: not walked
        if side is not None and (side.holding or not side.prefilter or side.prefilter(data, obj)):
            shape = skeleton(obj, chat=self._chat)
            if shape is None or shape != side.quiet:  # else: the last quiet event's side fields
                try:
                    verdict = side.feed(obj, raw=data, skeleton=shape)
                except InvalidSide:
                    return self.invalid(out)
                if isinstance(verdict, Cut):
                    return self._cut(verdict, out)
                if verdict is not None:  # a rewritten side field: the general path re-serialises
                    return self._general(None, verdict.obj, out, rewritten=True)
        if "usage" in obj or "error" in obj or "handoff" in obj or EXTENSION in obj:
            return self._general(raw if canonical else None, obj, out)
        choices = obj.get("choices")
        if type(choices) is not list or len(choices) != 1:
            return self._general(raw if canonical else None, obj, out)
        choice = choices[0]
        if type(choice) is not dict or choice.get("finish_reason") is not None:
            return self._general(raw if canonical else None, obj, out)
        if self._chat:
            delta = choice.get("delta")
            text = delta.get("content") if type(delta) is dict else None
        else:
            text = choice.get("text")
        index = choice.get("index", 0)
        mismatch = self.handoff is not None and not self.handoff.consistent
        if (
            type(text) is not str
            or not text
            or choice.get("logprobs") is not None
            or type(index) is not int
            or index in self._finished
            or not 0 <= index < MAX_CHOICES
            or mismatch
        ):
            return self._general(raw if canonical else None, obj, out)
        # The common chunk: one choice's text, nothing else to note (the same checks as the
        # general path, without its loops and lists).
        guard = self._guards.get(index) or self._guard(index)
        self.saw_text = True
        if guard.passes(text):  # the usual text: delivered as it is
            released = text
        else:
            fed = guard.feed(text)
            if isinstance(fed, Cut):
                return self._cut(fed, out)
            released = fed.text
        self.text_events += 1
        self._template = obj
        if released == text and canonical:
            out.append(raw)
            if side is None or (
                side.prefilter is None and shape is not None and shape == side.quiet
            ):
                self._frame = Frame.of(raw, text, chat=self._chat, guard=guard)
        elif released or more_than_text(self.endpoint, choice):
            out.append(encode_event(with_texts(self.endpoint, obj, [released])))
        return False

    def _general(
        self, raw: bytes | None, obj: dict[str, Any], out: list[bytes], *, rewritten: bool = False
    ) -> bool:
        """Every event the common-chunk path does not take: errors, usage, the handoff proof,
        several choices, finishes, logprobs, role and tool-call deltas."""
        if "error" in obj:
            out.append(encode_event(_relayed_error(obj)))
            return self._ended(Phase.FAILED, _error_code(obj))
        self._note(obj)
        stripped = without_engine_object(obj)  # the engine's kvguard object is not the tenant's
        if stripped is not obj:
            obj, raw = stripped, None
        if self.hidden_prompt_tokens and isinstance(obj.get("usage"), dict):
            obj, raw = own_usage(obj, self.hidden_prompt_tokens), None
        mismatch = self.handoff is not None and not self.handoff.consistent
        if mismatch and self.refuse_handoff_mismatch:
            out.append(error_event(HandoffMismatch.MESSAGE, HandoffMismatch.code))
            return self._ended(Phase.FAILED, HandoffMismatch.code)
        choices = obj.get("choices")
        if not choices:
            if "usage" not in obj:
                out.append(raw if raw is not None else encode_event(obj))
            elif self.wants_usage and self.disclosure is not None:
                self._usage_chunk = obj  # the final chunk: the kvguard object joins it at the end
            elif self.wants_usage:
                out.append(raw if raw is not None else encode_event(obj))
            return False
        try:
            return self._on_chunk(raw, obj, choices, out, rewritten=rewritten)
        except InvalidUpstream:
            return self.invalid(out)

    def relay_end(self, out: list[bytes]) -> None:
        """The engine's stream ended without ``[DONE]``: an upstream error, or the guards' Cut
        when finishing them finds one (what they held back is never delivered)."""
        cut = self._finish_guards()
        if cut is not None:
            self._cut(cut, out)
            return
        out.append(error_event("the engine ended the stream early", "upstream_error"))
        self._ended(Phase.FAILED, "upstream_error")

    def _ended(self, phase: Phase, code: str | None) -> bool:
        self.end, self.end_code = phase, code
        return True

    def _finish_guards(self) -> Cut | None:
        if self.cut is not None:
            return None
        for index in sorted(set(self._guards) - self._finished):
            verdict = self._finish_choice(index)
            if isinstance(verdict, Cut):
                return verdict
        side, self._side = self._side, None
        verdict_side = side.finish() if side is not None else None
        return verdict_side if isinstance(verdict_side, Cut) else None

    def invalid(self, out: list[bytes]) -> bool:
        out.append(error_event("the engine sent an invalid event", "upstream_error"))
        return self._ended(Phase.FAILED, "upstream_error")

    def _cut(self, cut: Cut, out: list[bytes]) -> bool:
        self.cut = cut
        out.append(cut_event(cut))
        return self._ended(Phase.CUT, cut.code)

    def _note(self, obj: dict[str, Any]) -> None:
        usage = obj.get("usage")
        if isinstance(usage, dict):
            if token_count(usage.get("completion_tokens")) is not None:
                self.completion_tokens = usage["completion_tokens"]
            if token_count(usage.get("prompt_tokens")) is not None:
                self.prompt_tokens = usage["prompt_tokens"]
        self.handoff = handoff_of(obj) or self.handoff

    def _guard(self, index: int) -> StreamGuard:
        guard = self._guards.get(index)
        if guard is None:
            if len(self._guards) >= MAX_CHOICES:
                raise InvalidUpstream("too many choices")
            guard = self._guards[index] = self.open_guard()
        return guard

    def _on_chunk(
        self,
        raw: bytes | None,
        obj: dict[str, Any],
        choices: Any,
        out: list[bytes],
        *,
        rewritten: bool = False,
    ) -> bool:
        if not isinstance(choices, list) or len(choices) > MAX_CHOICES:
            raise InvalidUpstream("choices is not a short list")
        texts: list[str] = []
        released: list[str] = []
        finishing = filled = False
        for position, choice in enumerate(choices):
            index = choice_index(choice, position)
            filled = fill_logprobs(self.endpoint, choice) or filled
            text = chunk_text(self.endpoint, choice)
            reason = choice.get("finish_reason")
            ends = reason is not None
            if isinstance(reason, str) and len(self.finish_reasons) < MAX_CHOICES:
                self.finish_reasons.append(reason[:64])
            verdict = self._feed_choice(index, text, ends=ends)
            if isinstance(verdict, Cut):
                return self._cut(verdict, out)
            texts.append(text)
            released.append(verdict.text)
            finishing = finishing or ends
        if any(texts):
            self.text_events += 1
        self._template = obj
        if raw is not None and released == texts and not filled:
            out.append(raw)
        elif (
            any(released)
            or finishing
            or rewritten
            or filled
            or "usage" in obj
            or any(more_than_text(self.endpoint, choice) for choice in choices)
        ):
            out.append(encode_event(with_texts(self.endpoint, obj, released)))
        return False  # else the event was only text, all of it held back: nothing to send yet

    def _feed_choice(self, index: int, text: str, *, ends: bool) -> Emit | Cut:
        if index in self._finished:
            if text:
                raise InvalidUpstream("text after the choice finished")
            return Emit("")
        verdict: Emit | Cut = Emit("")
        if text:
            self.saw_text = True
            verdict = self._guard(index).feed(text)
        if isinstance(verdict, Emit) and ends:
            verdict = _join(verdict, self._finish_choice(index))
        return verdict

    def _finish_choice(self, index: int) -> Emit | Cut:
        self._finished.add(index)
        guard = self._guards.get(index)
        return Emit("") if guard is None else guard.finish()

    def _on_done(self, done: bytes, out: list[bytes]) -> bool:
        tails = []
        for index in sorted(set(self._guards) - self._finished):
            tail = self._finish_choice(index)
            if isinstance(tail, Cut):
                return self._cut(tail, out)
            if tail.text and self._template is not None:
                tails.append(
                    encode_event(text_tail_chunk(self.endpoint, self._template, index, tail))
                )
        if self._side is not None:
            side = self._side.finish()
            if isinstance(side, Cut):
                return self._cut(side, out)
            if side and self._template is not None:
                tails.append(encode_event(tail_chunk(self._template, side, chat=self._chat)))
        out += tails
        if self.disclosure is not None:
            out.append(encode_event(self._final_chunk(self.disclosure)))
        out.append(done)
        return self._ended(Phase.COMPLETED, None)

    def _final_chunk(self, disclosure: Disclosure) -> dict[str, Any]:
        """The last chunk before ``[DONE]``: the usage chunk the client asked for, else one
        without choices, with the gateway's ``kvguard`` object (the guards are finished: the
        redaction count is final)."""
        if self._usage_chunk is not None:
            base = self._usage_chunk
        else:
            template = self._template or {"object": CHUNK_OBJECT[self._chat]}
            base = {k: v for k, v in template.items() if k not in ("choices", "usage")}
        return {**base, "choices": [], EXTENSION: disclosure.extension(self.handoff)}


# -- event parsing ---------------------------------------------------------------------------


def parse_json(data: str | bytes) -> Any:
    """orjson first (several times faster on an event); what it refuses and Python's parser reads
    (NaN and Infinity, lone surrogates, integers past 64 bits) is read as before."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(data)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc


def _join(first: Emit, second: Emit | Cut) -> Emit | Cut:
    return second if isinstance(second, Cut) else Emit(first.text + second.text)


def _relayed_error(obj: dict[str, Any]) -> dict[str, Any]:
    """An engine's error event as the client gets it: its ``error`` alone (not the engine's
    ``kvguard`` object), with no address in its strings (``gateway.proxy.disclosure``)."""
    error = obj.get("error")
    if isinstance(error, str):
        return {"error": scrubbed(error)}
    if not isinstance(error, dict):
        return {"error": error}
    return {"error": {k: scrubbed(v) if isinstance(v, str) else v for k, v in error.items()}}


def _error_code(obj: dict[str, Any]) -> str:
    error = obj.get("error")
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else "upstream_error"
