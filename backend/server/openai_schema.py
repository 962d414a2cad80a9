"""OpenAI-compatible request and response shapes of the engine's HTTP edge.

Unknown fields are refused (a typo must not silently change behaviour); every numeric field has
bounds, so a negative or huge ``max_tokens`` is a 400 with the field named, not an engine error.
A temperature above 0 but below ``MIN_SAMPLING_TEMPERATURE`` is served greedily (its limit):
dividing float32 logits by it overflows to inf and would fail the whole batch's step.

What this engine serves of OpenAI's request schema: ``n`` choices, ``logprobs`` (chat:
``top_logprobs`` alternatives; completions: an integer), presence/frequency penalties,
``logit_bias``, text content parts, the ``developer`` role, ``max_completion_tokens``, and
structured output and tools (``backend.server.structured``): ``response_format`` ``json_object``
and ``json_schema`` (``strict`` honoured), ``tools`` with ``tool_choice`` none/auto/required/named
and ``parallel_tool_calls``, ``tool`` messages and assistant ``tool_calls``. A constrained answer
(JSON, or a required or named tool call) takes no ``stop`` sequences: one would cut the JSON.
Without ``max_tokens`` a request gets as many tokens as fit its context (as OpenAI and vLLM do).
A null member of the body, a message or ``stream_options`` is not given (its default applies), as
OpenAI's nullable fields mean and SDKs send for a None (``contracts.openai.null_is_absent``).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backend.core.errors import InvalidRequest
from backend.core.request import MIN_SAMPLING_TEMPERATURE
from contracts.chat_format import message_text
from contracts.openai import check_logit_bias_keys, check_stops, lone_surrogate, null_is_absent

MAX_TOKENS_CEILING = 1 << 20
MAX_CHOICES = 16  # n; the gateway relays at most this many choices per answer
MAX_TOP_LOGPROBS = 20  # chat top_logprobs (OpenAI's bound)
MAX_COMPLETION_LOGPROBS = 5  # completions logprobs (OpenAI's bound)
MAX_LOGIT_BIAS = 1024
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOOLS = 128
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]


class _Request(BaseModel):
    """A request object whose null members are not given: their defaults apply
    (``contracts.openai.null_is_absent``, which the gateway applies too)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return null_is_absent(data)


class StreamOptions(_Request):
    include_usage: bool = False


class _UnicodeOnly(_Request):
    """Refuses a body holding a lone surrogate anywhere (a union-typed field such as ``content``
    or ``stop`` lets pydantic pass one through; the tokenizer then failed with a 500)."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_lone_surrogates(cls, data: Any) -> Any:
        path = lone_surrogate(data)
        if path is not None:  # not a ValueError: it reaches the handler with its param intact
            raise InvalidRequest(path, "text is not valid Unicode (it holds a lone surrogate)")
        return data


class _SamplingFields(_UnicodeOnly):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CEILING)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CEILING)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    user: str | None = Field(default=None, max_length=256)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, max_length=MAX_LOGIT_BIAS
    )

    @field_validator("temperature")
    @classmethod
    def _greedy_below_floor(cls, value: float) -> float:
        return 0.0 if value < MIN_SAMPLING_TEMPERATURE else value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        check_stops([value] if isinstance(value, str) else (value or []))
        return value

    @field_validator("logit_bias")
    @classmethod
    def _check_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        check_logit_bias_keys(value or {})
        return value

    @model_validator(mode="after")
    def _check_combinations(self) -> _SamplingFields:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def bias_items(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as (token id, bias); a token outside the vocabulary is a 400."""
        items = tuple((int(key), value) for key, value in (self.logit_bias or {}).items())
        for token, _ in items:
            if token >= vocab_size:
                problem = f"token id {token} is not in this model's vocabulary of {vocab_size}"
                raise InvalidRequest("logit_bias", problem)
        return items

    def top_logprobs_count(self) -> int | None:
        """Alternatives to report per token (0: the token's own logprob only); None: no logprobs."""
        return None


class CompletionRequest(_SamplingFields):
    prompt: str = Field(min_length=1)
    logprobs: Annotated[int, Field(ge=0, le=MAX_COMPLETION_LOGPROBS)] | None = None

    def top_logprobs_count(self) -> int | None:
        return self.logprobs


class FunctionCall(_Request):
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=1 << 20)


class ToolCall(_Request):
    """An assistant message's earlier call (OpenAI's ``tool_calls`` item)."""

    id: str = Field(min_length=1, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    """One chat turn; ``content`` is a string or a list of text parts (``{"type": "text",
    "text": ...}``, joined by newlines), or, for an assistant turn only, absent or null (OpenAI's
    schema allows it: an empty turn, or one that only calls tools). A ``tool`` turn answers the
    call named by ``tool_call_id``. Other part types are refused."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = Field(default=None, max_length=64)
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(default=None, min_length=1, max_length=128)

    @field_validator("role")
    @classmethod
    def _check_role(cls, value: str) -> str:
        if value not in ROLES:
            raise ValueError(f"must be one of {', '.join(ROLES)}")
        return value

    @field_validator("content")
    @classmethod
    def _check_content(cls, value: str | list[dict[str, Any]]) -> str | list[dict[str, Any]]:
        if isinstance(value, list):
            for position, part in enumerate(value):
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(
                        f"part {position} has type {str(kind)[:32]!r}: this engine reads text "
                        "parts only"
                    )
            if message_text(value) is None:
                raise ValueError("a text part is {'type': 'text', 'text': <string>}")
        return value

    @model_validator(mode="after")
    def _content_needed(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message (and only a tool message) needs tool_call_id")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        text = message_text(self.content)
        assert text is not None  # checked on validation
        return text

    def turn(self) -> dict[str, Any]:
        """What the chat template renders. ``developer`` is OpenAI's newer name for ``system``
        instructions; templates written before it know only ``system``. A call's arguments are
        given as an object where they are valid JSON (templates write them with ``tojson``, as
        transformers' and vLLM's do)."""
        role = "system" if self.role == "developer" else self.role
        turn: dict[str, Any] = {"role": role, "content": self.text()}
        if self.name is not None:
            turn["name"] = self.name
        if self.tool_call_id is not None:
            turn["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            turn["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": _arguments(call)},
                }
                for call in self.tool_calls
            ]
        return turn

    def __repr__(self) -> str:
        return f"ChatMessage(role={self.role!r}, content=<{len(self.text())} chars>)"


def _arguments(call: ToolCall) -> Any:
    try:
        return json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return call.function.arguments


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = Field(default=None, max_length=1 << 16)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Request):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type 'json_schema', and only then")
        return self


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        names = [tool.function.name for tool in self.tools or []]
        if len(names) != len(set(names)):
            raise ValueError("tools: two tools have the same name")
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not a tool")
        return self

    def top_logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_UnicodeOnly):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = Field(default=None, max_length=MAX_TOOLS)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
