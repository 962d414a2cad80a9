"""What a chat request asks of its answer's shape, and shaping the generated text into it.

``plan(body, fmt)`` reads the request once:

- nothing, or ``tool_choice: "none"``: TEXT, no grammar; the answer is content;
- ``response_format`` ``json_object`` / ``json_schema``: JSON, any object / the schema; content;
- ``tools`` with ``tool_choice`` ``auto`` (the default): AUTO, no grammar; content, or calls read
  from the text in the checkpoint's format (``backend.model.tool_calls``);
- ``tool_choice: "required"``: REQUIRED, the grammar of ``[{"name": <a tool>, "arguments": <its
  parameters>}, ...]`` (one item when ``parallel_tool_calls`` is false); calls;
- ``tool_choice`` naming a function: NAMED, that tool's parameters; one call.

(REQUIRED and NAMED are forced by the grammar in one JSON layout, as vLLM does, whatever the
family's own format: the calls are read back from that layout.) A tool without ``parameters``
takes any object. Every schema is compiled before anything is reserved (a bad one is a 400).

A ``Shaper`` turns one choice's released text into OpenAI's pieces, streamed or whole, by the
same code: ``push(text)`` -> content and tool-call deltas, ``finish(reason)`` -> the rest and the
choice's finish reason. Tool calls stream as OpenAI streams them: a first delta with the call's
``index``, ``id``, ``type`` and ``function.name`` (arguments ""), then argument deltas; a NAMED
call streams its arguments token by token, REQUIRED and AUTO calls as each one completes. How a
choice ends is honest:
- ``stop`` with calls: ``tool_calls`` (NAMED: ``stop``, as OpenAI answers a forced function);
- ``stop`` with text an AUTO format cannot read as calls: that text, as content, never dropped;
- ``length`` (the budget ran out, mid-JSON or not): ``length`` with the partial text as
  content, no calls;
- ``stop`` under a grammar whose text is not complete JSON cannot happen (the grammar allows the
  stop token only there); if it ever did, the choice fails (``GrammarViolation``) instead of
  ending "stop".
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from backend.core.errors import InvalidRequest
from backend.core.grammar import GrammarSpec, GrammarViolation
from backend.model.tool_calls import HERMES, ToolCallFormat
from backend.server.openai_schema import ChatCompletionRequest, NamedToolChoice

ANY_OBJECT: dict[str, Any] = {"type": "object"}


class Mode(StrEnum):
    TEXT = "text"
    JSON = "json"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True, slots=True)
class OutputPlan:
    mode: Mode = Mode.TEXT
    grammar: GrammarSpec | None = None
    tools: list[dict[str, Any]] | None = None  # what the chat template renders
    tool_name: str | None = None  # NAMED
    fmt: ToolCallFormat = HERMES

    @property
    def constrained(self) -> bool:
        return self.grammar is not None


TEXT = OutputPlan()


def plan(body: ChatCompletionRequest, fmt: ToolCallFormat) -> OutputPlan:
    tools = body.tools or []
    rendered = [t.model_dump(exclude_none=True, by_alias=True) for t in tools] or None
    choice = body.tool_choice
    if body.response_format is not None and body.response_format.type != "text":
        if tools and choice != "none":
            raise InvalidRequest("response_format", "give tools or a response_format, not both")
        return OutputPlan(Mode.JSON, _format_grammar(body), rendered, fmt=fmt)
    if not tools or choice == "none":
        return OutputPlan(Mode.TEXT, None, rendered, fmt=fmt)
    if choice is None or choice == "auto":
        return OutputPlan(Mode.AUTO, None, rendered, fmt=fmt)
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        schema = tool.function.parameters or ANY_OBJECT
        grammar = schema_spec(schema, strict=tool.function.strict is not False)
        return OutputPlan(Mode.NAMED, grammar, rendered, tool.function.name, fmt)
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "arguments": t.function.parameters or ANY_OBJECT,
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    calls: dict[str, Any] = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if body.parallel_tool_calls is False:
        calls["maxItems"] = 1
    strict = all(t.function.strict is not False for t in tools)
    return OutputPlan(Mode.REQUIRED, schema_spec(calls, strict=strict), rendered)


def schema_spec(schema: dict[str, Any], *, strict: bool) -> GrammarSpec:
    """The grammar of a JSON schema (compact text, the client's key order kept: properties are
    generated in it); a strict one with every object closed (``closed``)."""
    if strict:
        schema = closed(schema)
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    return GrammarSpec.json_schema(text, strict=strict)


# Where a JSON schema holds schemas: one schema, a list of them, or a map of names to them.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "patternProperties", "$defs", "definitions")


def closed(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say
    otherwise: OpenAI's strict mode, where no member the schema does not name may be written.
    xgrammar's ``strict_mode`` closes an object only when it lists ``properties`` (a bare
    ``{"type": "object"}`` stays any object, so a strict tool without parameters was given
    arbitrary arguments). Only schema positions are walked: an ``enum`` or ``const`` value that
    looks like a schema is data and stays as written."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    types = out.get("type")
    is_object = types == "object" or (isinstance(types, list) and "object" in types)
    if (is_object or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [closed(item) for item in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(item) for name, item in out[key].items()}
    if isinstance(out.get("items"), list):  # the older tuple form
        out["items"] = [closed(item) for item in out["items"]]
    return out


def _format_grammar(body: ChatCompletionRequest) -> GrammarSpec:
    assert body.response_format is not None
    spec = body.response_format.json_schema
    if spec is None:
        return GrammarSpec.json_object()
    if spec.schema_ is None:
        return GrammarSpec.json_object()
    return schema_spec(spec.schema_, strict=spec.strict is True)


@dataclass(slots=True)
class Pieces:
    """What one push or finish adds to a choice: content text and tool-call deltas."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, other: Pieces) -> Pieces:
        self.content += other.content
        self.calls += other.calls
        return self


@dataclass(slots=True)
class Shaper:
    """One choice's answer shape (see the module docstring)."""

    plan: OutputPlan
    request_id: str
    text: str = ""  # every released character
    content: str = ""  # what went out as content
    calls: list[dict[str, Any]] = field(default_factory=list)  # complete calls, OpenAI's shape
    _held: int = 0  # AUTO/REQUIRED: text from here on is not released yet
    _named_started: bool = False

    def push(self, text: str) -> Pieces:
        self.text += text
        mode = self.plan.mode
        if mode in (Mode.TEXT, Mode.JSON):
            return self._content(text)
        if mode is Mode.NAMED:
            return self._named(text)
        if mode is Mode.REQUIRED:
            return self._required()
        return self._auto()

    def finish(self, reason: str) -> tuple[Pieces, str]:
        mode = self.plan.mode
        if reason != "stop" or mode is Mode.TEXT:
            rest = self.text[self._held :] if mode in (Mode.AUTO, Mode.REQUIRED) else ""
            if mode in (Mode.REQUIRED, Mode.NAMED):
                self.calls = []  # cut by the budget: no call is known to be whole
            self._held = len(self.text)
            return self._content(rest), reason
        if mode is Mode.JSON:
            self._check_json(self.text)
            return Pieces(), reason
        if mode is Mode.NAMED:
            self._check_json(self.text)
            self.calls[0]["function"]["arguments"] = self.text
            return Pieces(), "stop"
        if mode is Mode.REQUIRED:
            self._check_json(self.text)
            return self._required(), "tool_calls"
        parsed = self.plan.fmt.parse(self.text)
        if not parsed.calls:
            rest = self.text[self._held :]
            self._held = len(self.text)
            return self._content(rest), reason
        out = Pieces()
        for call in parsed.calls:
            out.add(self._call(call.name, call.arguments))
        return out, "tool_calls"

    def result(self, reason: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """A whole answer's (content, tool_calls), after ``finish`` gave ``reason``."""
        if reason in ("stop", "tool_calls") and self.calls:
            return self.content.rstrip() or None, self.calls
        if self.plan.mode in (Mode.REQUIRED, Mode.NAMED):
            return self.text, None  # cut by the budget: the partial JSON, as text
        return self.content, None

    def _content(self, text: str) -> Pieces:
        self.content += text
        return Pieces(content=text)

    def _call(self, name: str, arguments: str) -> Pieces:
        index = len(self.calls)
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        function = {"name": name, "arguments": arguments}
        self.calls.append({"id": call_id, "type": "function", "function": function})
        head = {"index": index, "id": call_id, "type": "function"}
        first = {**head, "function": {"name": name, "arguments": ""}}
        deltas = [first]
        if arguments:
            deltas.append({"index": index, "function": {"arguments": arguments}})
        return Pieces(calls=deltas)

    def _named(self, text: str) -> Pieces:
        out = Pieces()
        if not self._named_started:
            self._named_started = True
            assert self.plan.tool_name is not None
            out.add(self._call(self.plan.tool_name, ""))
        if text:
            out.calls.append({"index": 0, "function": {"arguments": text}})
        return out

    def _required(self) -> Pieces:
        """Each item of the JSON array, as soon as it is complete."""
        decoder = json.JSONDecoder()
        out = Pieces()
        while True:
            at = self._held
            while at < len(self.text) and self.text[at] in "[, ":
                at += 1
            try:
                item, end = decoder.raw_decode(self.text, at)
            except json.JSONDecodeError:
                return out
            if not isinstance(item, dict):
                return out
            arguments = json.dumps(item.get("arguments"), ensure_ascii=False)
            out.add(self._call(str(item.get("name")), arguments))
            self._held = end

    def _auto(self) -> Pieces:
        start = self.plan.fmt.may_start_call(self.text[self._held :]) + self._held
        released = self.text[self._held : start]
        self._held = start
        return self._content(released)

    def _check_json(self, text: str) -> None:
        try:
            json.loads(text)
        except json.JSONDecodeError as exc:
            raise GrammarViolation(self.request_id, len(text)) from exc
