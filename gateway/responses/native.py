"""The Responses events of an engine that serves ``/v1/responses`` (SGLang, vLLM), screened and
re-stamped for the client.

Shapes follow vLLM 0.33.0 (``entrypoints/openai/responses/serving.py``
``responses_stream_generator``, ``streaming_events.py``: ``event: <type>`` + ``data:`` framing,
created -> in_progress -> items -> completed | incomplete, reasoning as ``reasoning_text``
parts) and SGLang 0.5.23 (``serving_responses.py``: also ``reasoning_summary_*`` events, and
``response.failed`` on an error).

Every event is rebuilt from the fields of its published schema, never passed on as it came:

- the lifecycle events carry the gateway's Response (``Envelope``: its id, the client's echo);
  from the engine's only the output, usage, status and incomplete reason are read;
- model text (``delta`` of output text, refusal, reasoning text and summaries, function-call
  arguments) goes through its stream's guard (``Streams``); every repeat of a full text (``*.done``
  events, ``content_part.done``, ``output_item.done``, the final response's output) is replaced by
  what was delivered for that stream, and a guard's held-back tail goes out as one more delta
  before its ``*.done``;
- the other strings copied from the engine (item ids, call ids, function names, an engine's error
  code and message) go through the side guards (``SideStrings``); enums and indices are checked,
  and anything else the engine adds is dropped (so it needs no screening);
- sequence numbers are the gateway's (events it drops or adds never leave gaps).

A guard's Cut, an event type or item the gateway cannot screen (or a final function call whose
name or call id no later turn could send back: ``objects.check_call``), an engine failure or a
stream that ends without its terminal event ends the stream as failed (``EventWriter.fail``:
never a truncated "completed"). ``whole_answer`` screens a non-streaming Response the same way.
Pure: no I/O.
"""

from __future__ import annotations

import json
from typing import Any

from contracts.plugins import Cut
from contracts.sse import parse_event
from gateway.lifecycle import Phase
from gateway.proxy.body import screen
from gateway.proxy.disclosure import without_addresses
from gateway.responses.events import EventWriter, Step
from gateway.responses.objects import Envelope, check_call, dumps, usage
from gateway.responses.screening import InvalidAnswer, Key, OpenGuard, SideStrings, Streams

KEEP_ALIVE = b": keep-alive\n\n"
INVALID = "the engine sent an event the gateway cannot screen"
ENDED_EARLY = "the engine ended the stream early"
_STATUSES = frozenset({"in_progress", "completed", "incomplete"})
_INCOMPLETE = frozenset({"max_output_tokens", "content_filter"})
# delta event -> (stream kind, its done event, the done event's text field, the index field)
_TEXT_EVENTS = {
    "response.output_text": ("output_text", "text", "content_index"),
    "response.refusal": ("refusal", "refusal", "content_index"),
    "response.reasoning_text": ("reasoning_text", "text", "content_index"),
    "response.reasoning_summary_text": ("summary_text", "text", "summary_index"),
    "response.function_call_arguments": ("arguments", "arguments", ""),
}
_PART_EVENTS = ("response.content_part.added", "response.content_part.done")
_SUMMARY_PART_EVENTS = (
    "response.reasoning_summary_part.added",
    "response.reasoning_summary_part.done",
)


def _index(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 4096:
        raise InvalidAnswer("an index out of range")
    return value


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise InvalidAnswer("a string field is not a string")
    return value


class NativeStream(EventWriter):
    def __init__(
        self,
        envelope: Envelope,
        open_guard: OpenGuard,
        *,
        hidden_prompt_tokens: int = 0,
        stream: bool = True,
    ) -> None:
        super().__init__(envelope, stream=stream)
        self._open = open_guard
        self._streams = Streams(open_guard)
        self._side = SideStrings(open_guard)
        self._hidden = hidden_prompt_tokens
        self._started: set[str] = set()
        self._opened: dict[Key, tuple[str, dict[str, Any]]] = {}  # text stream -> its delta event
        self._heads: dict[tuple[Key, str], str] = {}
        self.completion_tokens: int | None = None
        self.prompt_tokens: int | None = None

    # -- the pump's calls ---------------------------------------------------------------------

    def on_event(self, raw: bytes) -> Step:
        """One SSE event as the engine sent it (``contracts.sse.SseSplitter``)."""
        data, _ = parse_event(raw)
        if data is None:
            return Step(KEEP_ALIVE if self._stream else b"")
        try:
            event = json.loads(data)
        except (ValueError, RecursionError):
            return self.fail("upstream_error", INVALID)
        return self.on_object(event)

    def on_object(self, event: Any) -> Step:
        """One parsed event."""
        self.mark()
        try:
            if not isinstance(event, dict) or not isinstance(event.get("type"), str):
                raise InvalidAnswer("an event without a type")
            out = self._event(event)
        except InvalidAnswer:
            return self.fail("upstream_error", INVALID)
        if isinstance(out, Step):
            return out
        if isinstance(out, Cut):
            return self.cut(out)
        return Step(out)

    def upstream_ended(self) -> Step:
        """The stream ended without a terminal event: the guards' Cut if finishing them finds one
        (held-back text is never delivered), else an upstream error."""
        self.mark()
        tails = self._streams.close_all()
        if isinstance(tails, Cut):
            return self.cut(tails)
        side = self._side.finish()
        return self.cut(side) if side is not None else self.fail("upstream_error", ENDED_EARLY)

    def whole_answer(self, body: Any) -> Step:
        """A non-streaming Response from the engine, screened: ``response`` is the client's."""
        if not isinstance(body, dict):
            return self.fail("upstream_error", INVALID)
        status = body.get("status")
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        if status == "failed":
            kind = "response.failed"
        return self.on_object({"type": kind, "response": body})

    # -- events -------------------------------------------------------------------------------

    def _event(self, event: dict[str, Any]) -> bytes | Cut | Step:
        kind: str = event["type"]
        if kind in ("response.created", "response.in_progress", "response.queued"):
            return self._lifecycle(kind)
        if kind in ("response.completed", "response.incomplete"):
            return self._terminal(event.get("response"))
        if kind in ("response.failed", "error"):
            return self._engine_failure(event)
        base, _, phase = kind.rpartition(".")
        if base in _TEXT_EVENTS and phase in ("delta", "done"):
            return self._text_event(base, phase, event)
        if kind in _PART_EVENTS or kind in _SUMMARY_PART_EVENTS:
            return self._part_event(kind, event)
        if kind in ("response.output_item.added", "response.output_item.done"):
            return self._item_event(kind, event)
        raise InvalidAnswer("an event type the gateway does not screen")

    def _lifecycle(self, kind: str) -> bytes:
        if kind == "response.queued" or kind in self._started:
            return b""
        self._started.add(kind)
        initial = self._env.response(status="in_progress", output=[])
        return self.emit(kind, {"response": initial})

    def _where(
        self, event: dict[str, Any], index_field: str
    ) -> tuple[dict[str, Any], tuple[int, int]]:
        output_index = _index(event.get("output_index"))
        item_id = _str(event.get("item_id"))
        where: dict[str, Any] = {"item_id": item_id, "output_index": output_index}
        sub = 0
        if index_field:
            sub = where[index_field] = _index(event.get(index_field))
        return where, (output_index, sub)

    def _text_event(self, base: str, phase: str, event: dict[str, Any]) -> bytes | Cut:
        stream_kind, text_field, index_field = _TEXT_EVENTS[base]
        where, (output_index, sub) = self._where(event, index_field)
        cut = self._side.feed_one("item_id", where["item_id"])
        if cut is not None:
            return cut
        key: Key = (stream_kind, output_index, sub)
        self._opened.setdefault(key, (base, where))
        extra: dict[str, Any] = {"logprobs": []} if stream_kind == "output_text" else {}
        if phase == "delta":
            sent = self._streams.feed(key, _str(event.get("delta")))
            if isinstance(sent, Cut) or not sent:
                return sent if isinstance(sent, Cut) else b""
            head = self._heads.get((key, where["item_id"]))
            if head is None:  # the event's JSON up to its delta, made once per stream and item
                head = dumps({"type": f"{base}.delta", **where})[:-1] + ',"delta":'
                self._heads[(key, where["item_id"])] = head
            tail = ',"logprobs":[]' if extra else ""
            return self.emit_raw(f"{base}.delta", f"{head}{dumps(sent)}{tail}")
        full = self._streams.full(key, _str(event.get(text_field)))
        if isinstance(full, Cut):
            return full
        out = self._close(key, where, base, extra)
        if isinstance(out, Cut):
            return out
        done = {**where, text_field: self._streams.text(key), **extra}
        if stream_kind == "arguments":
            name = self._side_value("name", event.get("name"))
            if isinstance(name, Cut):
                return name
            done["name"] = name
        return out + self.emit(f"{base}.done", done)

    def _close(
        self, key: Key, where: dict[str, Any], base: str, extra: dict[str, Any]
    ) -> bytes | Cut:
        """Close ``key``: its guard's tail as one more delta (if any)."""
        tail = self._streams.close(key)
        if isinstance(tail, Cut) or not tail:
            return tail if isinstance(tail, Cut) else b""
        return self.emit(f"{base}.delta", {**where, "delta": tail, **extra})

    def _part_event(self, kind: str, event: dict[str, Any]) -> bytes | Cut:
        summary = kind in _SUMMARY_PART_EVENTS
        where, (output_index, sub) = self._where(
            event, "summary_index" if summary else "content_index"
        )
        cut = self._side.feed([("item_id", where["item_id"])])
        if cut is not None:
            return cut
        part = event.get("part")
        if not isinstance(part, dict):
            raise InvalidAnswer("a part that is not an object")
        rebuilt = self._part(part, output_index, sub, summary=summary)
        if isinstance(rebuilt, Cut):
            return rebuilt
        return self.emit(kind, {**where, "part": rebuilt})

    def _item_event(self, kind: str, event: dict[str, Any]) -> bytes | Cut:
        output_index = _index(event.get("output_index"))
        item = event.get("item")
        rebuilt = self._item(item, output_index)
        if isinstance(rebuilt, Cut):
            return rebuilt
        return self.emit(kind, {"output_index": output_index, "item": rebuilt})

    def _terminal(self, response: Any) -> Step | Cut:
        if not isinstance(response, dict) or not isinstance(response.get("output", []), list):
            raise InvalidAnswer("a final response without output")
        items = response.get("output", [])
        output = self._output(items)  # feeds a text no delta carried (a whole answer's)
        if isinstance(output, Cut):
            return output
        out = b""
        tails = self._streams.close_all()
        if isinstance(tails, Cut):
            return tails
        for key, tail in tails:  # streams whose done event never came
            if key in self._opened:
                base, where = self._opened[key]
                extra: dict[str, Any] = {"logprobs": []} if key[0] == "output_text" else {}
                out += self.emit(f"{base}.delta", {**where, "delta": tail, **extra})
        if tails:
            output = self._output(items)  # again, now with what the guards held back
            if isinstance(output, Cut):
                return output
        side = self._side.finish()
        if side is not None:
            return side
        details = response.get("incomplete_details")
        reason = details.get("reason") if isinstance(details, dict) else None
        incomplete = response.get("status") == "incomplete"
        if incomplete and reason not in _INCOMPLETE:
            reason = "max_output_tokens"
        usage = self._usage(response.get("usage"))
        status = "incomplete" if incomplete else "completed"
        self.response = self._env.response(
            status=status,
            output=output,
            usage=usage,
            incomplete_reason=reason if incomplete else None,
            completed_at=self._env.created_at if not incomplete else None,
        )
        return Step(
            out + self.emit(f"response.{status}", {"response": self.response}), Phase.COMPLETED
        )

    def _output(self, items: list[Any]) -> list[dict[str, Any]] | Cut:
        output = []
        for output_index, item in enumerate(items):
            rebuilt = self._item(item, output_index)
            if isinstance(rebuilt, Cut):
                return rebuilt
            if rebuilt["type"] == "function_call":  # as stored: what a later turn sends back
                check_call(rebuilt["name"], rebuilt["call_id"])
            output.append(rebuilt)
        return output

    def _engine_failure(self, event: dict[str, Any]) -> Step | Cut:
        """An engine's ``error`` event or ``response.failed``: its code and message in an
        upstream error's message, screened as that one text (a marker begun in the code and ended
        in the message is read whole)."""
        error: Any = event
        if event["type"] == "response.failed":
            response = event.get("response")
            error = response.get("error") if isinstance(response, dict) else None
        error = error if isinstance(error, dict) else {}
        code, message = (error.get(name) for name in ("code", "message"))
        failed = screen(
            self._open(),
            f"the engine failed ({code if isinstance(code, str) else ''}): "
            f"{message if isinstance(message, str) else ''}",
        )
        if isinstance(failed, Cut):
            return failed
        return self.fail("upstream_error", without_addresses(failed))

    # -- items and parts ----------------------------------------------------------------------

    def _item(self, item: Any, output_index: int) -> dict[str, Any] | Cut:
        if not isinstance(item, dict):
            raise InvalidAnswer("an item that is not an object")
        kind = item.get("type")
        item_id = self._side_value("item.id", item.get("id"))
        if isinstance(item_id, Cut):
            return item_id
        status = str(item["status"]) if item.get("status") in _STATUSES else "completed"
        if kind == "message":
            parts = [self._part(p, output_index, i) for i, p in enumerate(_list(item, "content"))]
            return _first_cut(parts) or {
                "id": item_id, "type": "message", "role": "assistant", "status": status,
                "content": parts,
            }  # fmt: skip
        if kind == "reasoning":
            summary = [
                self._part(p, output_index, i, summary=True)
                for i, p in enumerate(_list(item, "summary"))
            ]
            content = [self._part(p, output_index, i) for i, p in enumerate(_list(item, "content"))]
            return _first_cut([*summary, *content]) or {
                "id": item_id, "type": "reasoning", "status": status, "summary": summary,
                "content": content,
            }  # fmt: skip
        if kind == "function_call":
            return self._call(item, item_id, status, output_index)
        raise InvalidAnswer("an item type the gateway does not screen")

    def _call(
        self, item: dict[str, Any], item_id: str, status: str, output_index: int
    ) -> dict[str, Any] | Cut:
        call_id = self._side_value("item.call_id", item.get("call_id"))
        name = self._side_value("item.name", item.get("name"))
        arguments = self._streams.full(
            ("arguments", output_index, 0), _str(item.get("arguments", ""))
        )
        for value in (call_id, name, arguments):
            if isinstance(value, Cut):
                return value
        return {
            "id": item_id, "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments,
        }  # fmt: skip

    def _part(self, part: Any, output_index: int, sub: int, *, summary: bool = False) -> Any:
        if not isinstance(part, dict):
            raise InvalidAnswer("a part that is not an object")
        kind = part.get("type")
        if summary:
            if kind != "summary_text":
                raise InvalidAnswer("a summary part that is not summary_text")
            text = self._streams.full(
                ("summary_text", output_index, sub), _str(part.get("text", ""))
            )
            return text if isinstance(text, Cut) else {"type": "summary_text", "text": text}
        if kind == "refusal":
            text = self._streams.full(("refusal", output_index, sub), _str(part.get("refusal", "")))
            return text if isinstance(text, Cut) else {"type": "refusal", "refusal": text}
        if kind not in ("output_text", "reasoning_text"):
            raise InvalidAnswer("a part type the gateway does not screen")
        text = self._streams.full((kind, output_index, sub), _str(part.get("text", "")))
        if isinstance(text, Cut):
            return text
        if kind == "reasoning_text":
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _side_value(self, key: str, value: Any) -> str | Cut:
        value = _str(value)
        cut = self._side.feed([(key, value)])
        return cut if cut is not None else value

    # -- usage, endings and encoding ------------------------------------------------------------

    def _usage(self, engine_usage: Any) -> dict[str, Any] | None:
        """The engine's ``ResponseUsage``, its counts checked, the hooks' prompt tokens out."""
        if not isinstance(engine_usage, dict):
            return None
        chat_like = {
            "prompt_tokens": engine_usage.get("input_tokens"),
            "completion_tokens": engine_usage.get("output_tokens"),
            "prompt_tokens_details": engine_usage.get("input_tokens_details"),
            "completion_tokens_details": engine_usage.get("output_tokens_details"),
        }
        converted = usage(chat_like, hidden_prompt_tokens=self._hidden)
        self.completion_tokens = converted["output_tokens"]
        self.prompt_tokens = converted["input_tokens"] + self._hidden
        return converted


def _list(item: dict[str, Any], name: str) -> list[Any]:
    value = item.get(name) or []
    if not isinstance(value, list):
        raise InvalidAnswer("a list field is not a list")
    return value


def _first_cut(values: list[Any]) -> Cut | None:
    return next((v for v in values if isinstance(v, Cut)), None)
