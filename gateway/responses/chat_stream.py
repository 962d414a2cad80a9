"""A chat completion, streamed or whole, turned into a Response and its full event sequence, for
engines that do not serve ``/v1/responses`` (the bundled engine, a prefill/decode pair, providers
through litellm). Screened as it goes: every string the answer copies from the engine passes the
request's response guards (``gateway.responses.screening``).

Lifecycle of one ``ChatToResponses`` (one per request; the pump calls it, pure: no I/O)::

    start()              -> response.created, response.in_progress      (bytes, once)
    feed(chunk)          -> Step: the events of one parsed chat chunk     (per upstream event)
    done()               -> Step: the items closed, response.completed | .incomplete ([DONE])
    upstream_ended()     -> Step: error + response.failed               (no [DONE])
    fail(code, message)  -> Step: error + response.failed               (any other failure)

A chunk's ``delta.reasoning_content`` (or ``reasoning``) opens a ``reasoning`` item, ``content``
and ``refusal`` the parts of a ``message`` item, each ``tool_calls[i]`` a ``function_call`` item;
a new kind closes the text item before it (as vLLM 0.33.0's
``entrypoints/openai/responses/streaming_events.py`` ``SimpleStreamingEventProcessor`` does).
Closing a part sends what its guard still held as one more delta, then its ``*.done`` events with
the delivered text. ``finish_reason`` "length" makes the items and the response incomplete
(``max_output_tokens``), "content_filter" the response (``content_filter``); the usage chunk that
follows (the gateway always asks for one) becomes the response's usage. A guard's Cut, an engine
error event, an invalid chunk (a tool call whose name or id no later turn could send back among
them: ``objects.check_call``) or a stream without ``[DONE]`` ends it as failed
(``events.EventWriter.fail``), never a truncated "completed".

A text delta costs one guard call and one event built from a prefix made when its part opened.
``whole_answer`` runs a non-streaming chat completion through the same machine (no events built),
so both paths screen and shape the answer alike; ``response`` is the final Response object either
way (what the gateway stores and returns).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from contracts.plugins import Cut
from gateway.lifecycle import Phase
from gateway.proxy.body import screen
from gateway.proxy.disclosure import without_addresses
from gateway.responses.events import EventWriter, Step
from gateway.responses.objects import Envelope, check_call, dumps, new_id, usage
from gateway.responses.screening import InvalidAnswer, Key, OpenGuard, Streams

INVALID = "the engine sent an invalid event"
ENDED_EARLY = "the engine ended the stream early"
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
_DELTA_TYPES = {
    "output_text": "response.output_text.delta",
    "refusal": "response.refusal.delta",
    "reasoning_text": "response.reasoning_text.delta",
    "arguments": "response.function_call_arguments.delta",
}


@dataclass(slots=True)
class _Part:
    kind: str  # output_text | refusal | reasoning_text | arguments
    key: Key
    index: int  # content_index
    prefix: str  # the delta event's JSON up to its "delta" value


@dataclass(slots=True)
class _Item:
    kind: str  # message | reasoning | function_call
    index: int  # output_index
    id: str
    parts: list[_Part] = field(default_factory=list)
    name: str = ""
    call_id: str = ""
    done: bool = False


class ChatToResponses(EventWriter):
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
        self._hidden = hidden_prompt_tokens
        self._items: list[_Item] = []
        self._text_item: _Item | None = None  # the open message or reasoning item
        self._calls: dict[int, _Item] = {}  # chat tool-call index -> its item
        self._output: list[dict[str, Any]] = []  # finished items, in output order
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None
        self.completion_tokens: int | None = None
        self.prompt_tokens: int | None = None  # the engine's count (hooks' additions included)

    # -- the pump's calls ---------------------------------------------------------------------

    def start(self) -> bytes:
        initial = self._env.response(status="in_progress", output=[])
        return self.emit("response.created", {"response": initial}) + self.emit(
            "response.in_progress", {"response": initial}
        )

    def feed(self, chunk: dict[str, Any]) -> Step:
        self.mark()
        try:
            return self._feed(chunk)
        except InvalidAnswer:
            return self.fail("upstream_error", INVALID)

    def done(self) -> Step:
        """``[DONE]``: close what is open, then the terminal event."""
        self.mark()
        try:
            out = self._close_open_items()
        except InvalidAnswer:
            return self.fail("upstream_error", INVALID)
        if isinstance(out, Cut):
            return self.cut(out)
        reason = _INCOMPLETE.get(self._finish or "")
        status = "completed" if reason is None else "incomplete"
        self.response = self._env.response(
            status=status,
            output=self._output,
            usage=self._usage,
            incomplete_reason=reason,
            completed_at=self._env.created_at if status == "completed" else None,
        )
        out += self.emit(f"response.{status}", {"response": self.response})
        return Step(out, Phase.COMPLETED)

    def upstream_ended(self) -> Step:
        """The engine's stream ended without ``[DONE]``: the guards' Cut if finishing them finds
        one (what they held back is never delivered), else an upstream error."""
        self.mark()
        tails = self._streams.close_all()
        if isinstance(tails, Cut):
            return self.cut(tails)
        return self.fail("upstream_error", ENDED_EARLY)

    def whole_answer(self, completion: dict[str, Any]) -> Step:
        """A non-streaming chat completion through the same machine: ``response`` is the
        Response (or the failed one), the Step's ``end`` how it ended."""
        choices = completion.get("choices")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            return self.fail("upstream_error", INVALID)
        message = choices[0].get("message")
        delta = (
            {k: v for k, v in message.items() if k != "role"} if isinstance(message, dict) else {}
        )
        calls = delta.get("tool_calls")
        if isinstance(calls, list):
            delta["tool_calls"] = [
                {**call, "index": position} if isinstance(call, dict) else call
                for position, call in enumerate(calls)
            ]
        chunk = {"choices": [{"index": 0, "delta": delta, **_finish(choices[0])}]}
        step = self.feed(chunk)
        if step.end is None and isinstance(completion.get("usage"), dict):
            step = self.feed({"choices": [], "usage": completion["usage"]})
        return step if step.end is not None else self.done()

    # -- one chunk ----------------------------------------------------------------------------

    def _feed(self, chunk: dict[str, Any]) -> Step:
        if "error" in chunk:
            return self._engine_error(chunk["error"])
        if isinstance(chunk.get("usage"), dict):
            self._note_usage(chunk["usage"])
        choices = chunk.get("choices")
        if not choices:
            return Step(b"")
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise InvalidAnswer("a Responses answer has one choice")
        choice = choices[0]
        if choice.get("index", 0) != 0:
            raise InvalidAnswer("a Responses answer has one choice")
        delta = choice.get("delta")
        out = self._delta(delta) if isinstance(delta, dict) and delta else b""
        if isinstance(out, Cut):
            return self.cut(out)
        reason = choice.get("finish_reason")
        if reason is not None:
            if self._finish is not None or not isinstance(reason, str):
                raise InvalidAnswer("a second finish")
            self._finish = reason
            closed = self._close_open_items()
            if isinstance(closed, Cut):
                return self.cut(closed)
            out += closed
        return Step(out)

    def _delta(self, delta: dict[str, Any]) -> bytes | Cut:
        if self._finish is not None:
            if any(delta.get(k) for k in ("content", "refusal", "reasoning_content", "tool_calls")):
                raise InvalidAnswer("text after the finish")
            return b""
        out = b""
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        for kind, text in (
            ("reasoning_text", reasoning),
            ("output_text", delta.get("content")),
            ("refusal", delta.get("refusal")),
        ):
            if text is None or text == "":
                continue
            if not isinstance(text, str):
                raise InvalidAnswer("a text that is not a string")
            sent = self._text(kind, text)
            if isinstance(sent, Cut):
                return sent
            out += sent
        calls = delta.get("tool_calls")
        if calls:
            if not isinstance(calls, list):
                raise InvalidAnswer("tool_calls is not a list")
            for call in calls:
                sent = self._tool_call(call)
                if isinstance(sent, Cut):
                    return sent
                out += sent
        return out

    def _text(self, kind: str, text: str) -> bytes | Cut:
        item_kind = "reasoning" if kind == "reasoning_text" else "message"
        out = b""
        item = self._text_item
        if item is None or item.kind != item_kind or self._calls_open():
            closed = self._close_open_items()
            if isinstance(closed, Cut):
                return closed
            out += closed
            item = self._text_item = self._open_item(
                item_kind, "rs" if kind == "reasoning_text" else "msg"
            )
            out += self._added(item)
        part = next((p for p in item.parts if p.kind == kind), None)
        if part is None:
            part = self._add_part(item, kind)
            out += self._part_added(item, part)
        sent = self._send_delta(part, text)
        return sent if isinstance(sent, Cut) else out + sent

    def _tool_call(self, call: Any) -> bytes | Cut:
        if not isinstance(call, dict) or not isinstance(call.get("index", 0), int):
            raise InvalidAnswer("a tool call is not an object with an index")
        raw_function = call.get("function")
        function: dict[str, Any] = raw_function if isinstance(raw_function, dict) else {}
        arguments = function.get("arguments") or ""
        if not isinstance(arguments, str):
            raise InvalidAnswer("tool-call arguments are not a string")
        out = b""
        item = self._calls.get(call.get("index", 0))
        if item is None:
            if self._text_item is not None:
                closed = self._close_item(self._text_item)
                if isinstance(closed, Cut):
                    return closed
                out += closed
                self._text_item = None
            opened = self._open_call(call, function)
            if isinstance(opened, Cut):
                return opened
            item = opened
            out += self._added(item)
        if not arguments:
            return out
        sent = self._send_delta(item.parts[0], arguments)
        return sent if isinstance(sent, Cut) else out + sent

    def _open_call(self, call: dict[str, Any], function: dict[str, Any]) -> _Item | Cut:
        name, call_id = function.get("name"), call.get("id")
        if not isinstance(name, str) or not name:
            raise InvalidAnswer("a tool call without a name")
        screened_name = screen(self._open(), name)
        if isinstance(screened_name, Cut):
            return screened_name
        screened_id = screen(self._open(), call_id) if isinstance(call_id, str) and call_id else ""
        if isinstance(screened_id, Cut):
            return screened_id
        if len(self._calls) >= 128:
            raise InvalidAnswer("too many tool calls")
        call_id = screened_id or new_id("call")
        check_call(screened_name, call_id)
        item = self._open_item("function_call", "fc")
        item.name, item.call_id = screened_name, call_id
        self._add_part(item, "arguments")
        self._calls[call.get("index", 0)] = item
        return item

    # -- items and parts ----------------------------------------------------------------------

    def _open_item(self, kind: str, prefix: str) -> _Item:
        item = _Item(kind, len(self._items), new_id(prefix))
        self._items.append(item)
        return item

    def _add_part(self, item: _Item, kind: str) -> _Part:
        index = len(item.parts)
        head = f'"type":"{_DELTA_TYPES[kind]}","item_id":"{item.id}","output_index":{item.index}'
        if kind != "arguments":
            head += f',"content_index":{index}'
        part = _Part(kind, (kind, item.index, index), index, "{" + head + ',"delta":')
        item.parts.append(part)
        return part

    def _send_delta(self, part: _Part, text: str) -> bytes | Cut:
        sent = self._streams.feed(part.key, text)
        if isinstance(sent, Cut) or not sent or not self._stream:
            return b"" if isinstance(sent, str) else sent
        return self._tail(part, sent)

    def _calls_open(self) -> bool:
        return any(not item.done for item in self._calls.values())

    def _close_open_items(self) -> bytes | Cut:
        out = b""
        open_items = [i for i in self._calls.values() if not i.done]
        if self._text_item is not None:
            open_items.insert(0, self._text_item)
            self._text_item = None
        for item in sorted(open_items, key=lambda i: i.index):
            closed = self._close_item(item)
            if isinstance(closed, Cut):
                return closed
            out += closed
        return out

    def _close_item(self, item: _Item) -> bytes | Cut:
        status = "incomplete" if self._finish == "length" else "completed"
        out = b""
        parts = []
        for part in item.parts:
            tail = self._streams.close(part.key)
            if isinstance(tail, Cut):
                return tail
            if tail and self._stream:
                out += self._tail(part, tail)
            text = self._streams.text(part.key)
            obj = _part_object(part.kind, text)
            parts.append(obj)
            out += self._part_done(item, part, text, obj)
        item.done = True
        finished = _item_object(item, parts, status)
        self._output.append(finished)
        done = {"output_index": item.index, "item": finished}
        return out + self.emit("response.output_item.done", done)

    def _tail(self, part: _Part, text: str) -> bytes:
        logprobs = ',"logprobs":[]' if part.kind == "output_text" else ""
        return self.emit_raw(_DELTA_TYPES[part.kind], f"{part.prefix}{dumps(text)}{logprobs}")

    def _added(self, item: _Item) -> bytes:
        return self.emit(
            "response.output_item.added",
            {"output_index": item.index, "item": _item_object(item, [], "in_progress")},
        )

    def _part_added(self, item: _Item, part: _Part) -> bytes:
        return self.emit(
            "response.content_part.added",
            {
                "item_id": item.id,
                "output_index": item.index,
                "content_index": part.index,
                "part": _part_object(part.kind, ""),
            },
        )

    def _part_done(self, item: _Item, part: _Part, text: str, obj: dict[str, Any]) -> bytes:
        where = {"item_id": item.id, "output_index": item.index}
        if part.kind == "arguments":
            done = {**where, "name": item.name, "arguments": text}
            return self.emit("response.function_call_arguments.done", done)
        where["content_index"] = part.index
        field_name = "refusal" if part.kind == "refusal" else "text"
        done = {**where, field_name: text}
        if part.kind == "output_text":
            done["logprobs"] = []
        kind = "reasoning_text" if part.kind == "reasoning_text" else part.kind
        out = self.emit(f"response.{kind}.done", done)
        return out + self.emit("response.content_part.done", {**where, "part": obj})

    # -- endings and encoding -----------------------------------------------------------------

    def _note_usage(self, chat_usage: dict[str, Any]) -> None:
        self._usage = usage(chat_usage, hidden_prompt_tokens=self._hidden)
        if isinstance(chat_usage.get("completion_tokens"), int):
            self.completion_tokens = chat_usage["completion_tokens"]
        if isinstance(chat_usage.get("prompt_tokens"), int):
            self.prompt_tokens = chat_usage["prompt_tokens"]

    def _engine_error(self, error: Any) -> Step:
        """An engine's error event: its code and message, screened and without addresses
        (``gateway.proxy.disclosure``), end the stream as failed. Each is screened, and so is
        ``CODE: MESSAGE`` (the failed Response's message, ``objects.failure_error``), so a marker
        begun in the code and ended in the message is read whole."""
        error = error if isinstance(error, dict) else {}
        found = []
        for name, default in (("code", "upstream_error"), ("message", "the engine failed")):
            value = error.get(name)
            found.append(value if isinstance(value, str) and value else default)
        found.append(f"{found[0]}: {found[1]}")
        screened = [screen(self._open(), value) for value in found]
        for value in screened:
            if isinstance(value, Cut):
                return self.cut(value)
        code, message = (without_addresses(str(value)) for value in screened[:2])
        return self.fail(code, message)


def _finish(choice: dict[str, Any]) -> dict[str, Any]:
    reason = choice.get("finish_reason")
    return {"finish_reason": reason if isinstance(reason, str) else "stop"}


def _part_object(kind: str, text: str) -> dict[str, Any]:
    """A finished part (``arguments``: the text, which its item carries)."""
    if kind == "arguments":
        return {"arguments": text}
    if kind == "output_text":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    if kind == "refusal":
        return {"type": "refusal", "refusal": text}
    return {"type": "reasoning_text", "text": text}


def _item_object(item: _Item, parts: list[dict[str, Any]], status: str) -> dict[str, Any]:
    if item.kind == "function_call":
        arguments = parts[0]["arguments"] if parts else ""
        return {
            "id": item.id,
            "type": "function_call",
            "status": status,
            "call_id": item.call_id,
            "name": item.name,
            "arguments": arguments,
        }
    if item.kind == "reasoning":
        return {
            "id": item.id,
            "type": "reasoning",
            "status": status,
            "summary": [],
            "content": parts,
        }
    return {
        "id": item.id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": parts,
    }
