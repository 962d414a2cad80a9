"""OpenAI-compatible request bodies the gateway accepts (HTTP edge; tables live in db.models).

Every field of OpenAI's published request schemas for chat completions and completions is
declared here, so a request any OpenAI client may send is read, not refused as unknown; what each
engine kind does with each field (forward, refuse at the door) is decided in one place,
``gateway.openai.surface``.
Unknown fields, wrong JSON types and out-of-range numbers are 400s naming
the field, before any engine is asked anything. The fields the gateway itself interprets (model,
messages, prompt, token limits, n, stream) are typed exactly, and so are the tools and an
assistant's tool calls (OpenAI's function tools: an engine's chat template renders them, and its
tokenizer refused a malformed one: a 502); the objects it only passes on (response_format,
metadata, ...) are checked for their outer shape, their depth (at most
``contracts.openai.MAX_JSON_DEPTH`` levels) and every string in them for valid Unicode.

What the engine receives is exactly the fields the client set (less what ``surface`` drops for
that engine), plus the ``max_tokens`` the gateway enforced and the usage request it needs. A null
is not a value set: OpenAI's schemas make every optional field nullable, and a null there means the
default (``contracts.openai.null_is_absent``, which the engine's schema applies too), so nothing
is forwarded for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from contracts.openai import (
    LONE_SURROGATE,
    MAX_STOP_SEQUENCES,
    check_logit_bias_keys,
    check_passed_on,
    check_stops,
    null_is_absent,
    text_checked,
)
from gateway.db.text import StoredText

MAX_TOKENS_CEILING = 1 << 20
MAX_MESSAGES = 1024  # messages of a chat request (Responses: input items)
MAX_CHOICES = 16  # n: the relay screens at most this many choices per answer
MAX_TOOLS = 128  # tools of a request, calls of a message
MAX_PARTS = 256  # content parts of one message
MAX_REQUEST_PARTS = 4096
"""Content parts of one request, all messages (Responses: all items) together. OpenAI's schema
bounds neither; 4096 is 4 per message at the 1024 messages allowed, and 8x the 500 images a
request may carry on OpenAI's vision models. Each part is ~5 us of validation on the event loop
every tenant shares: 310k-460k parts of one message held it for 2.2-2.7 s; 4096 cost ~15 ms."""
MAX_MODALITIES = 4  # OpenAI's ResponseModalities has two values ("text", "audio")
CONTENT_PART_TYPES = ("text", "image_url", "input_audio", "file", "refusal")


def _unicode(value: str) -> str:
    """JSON may escape a lone UTF-16 surrogate (\\ud800); no engine can encode that text
    (orjson refuses one: a body it parsed is not looked at, ``contracts.openai.text_checked``)."""
    if text_checked():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(LONE_SURROGATE) from None
    return value


def _unicode_within(value: Any) -> Any:
    """Every string in a passed-on object (keys too) is valid Unicode, and the object is nested
    at most ``contracts.openai.MAX_JSON_DEPTH`` deep."""
    check_passed_on(value)
    return value


def check_part_count(contents: Iterable[Any]) -> None:
    """At most ``MAX_REQUEST_PARTS`` content parts in ``contents`` (each a message's raw content:
    a list of parts or anything else), counted without reading a part."""
    if sum(len(c) for c in contents if isinstance(c, list)) > MAX_REQUEST_PARTS:
        raise ValueError(f"at most {MAX_REQUEST_PARTS} content parts in a request")


Text = Annotated[str, AfterValidator(_unicode)]  # every free-text field of a request
Json = Annotated[Any, AfterValidator(_unicode_within)]  # an object the gateway only passes on
JsonObject = Annotated[dict[str, Any], AfterValidator(_unicode_within)]
JsonObjects = Annotated[list[dict[str, Any]], AfterValidator(_unicode_within)]


# A function's name, as OpenAI's FunctionObject asks (letters, digits, '_' and '-', at most 64;
# '.' too, which vLLM and the bundled engine take): a name no engine renders is a 400 here, not
# a refusal of the engine's tokenizer (a 502).
ToolName = Annotated[Text, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]


def validated(model: type[BaseModel], value: Any) -> Any:
    """``model`` read from ``value``, or a ValueError with its first problem: a pydantic error
    with its place (``text: Input should be a valid string``), one of ours as it is (ours say
    where)."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        place = ".".join(str(part) for part in first["loc"])
        if first["type"] == "extra_forbidden":
            raise ValueError(f"unknown field '{place}'") from None
        if first["type"] == "value_error":
            raise ValueError(str(first["ctx"]["error"])) from None
        raise ValueError(f"{place}: {first['msg']}" if place else first["msg"]) from None


class _Request(BaseModel):
    """A request object whose null members are not given (``contracts.openai.null_is_absent``):
    not in ``model_fields_set``, so neither decided by ``surface`` nor forwarded."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        return null_is_absent(data)


class StreamOptions(_Request):
    include_usage: bool = False
    include_obfuscation: bool | None = None


class ContentPart(BaseModel):
    """One part of a message's content: ``{"type": "text", "text": ...}`` (no other key) or a
    non-text part (``image_url``, ``input_audio``, ``file``, ``refusal``) passed on as is."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "image_url", "input_audio", "file", "refusal"]
    text: Text | None = None

    @model_validator(mode="after")
    def _check(self) -> ContentPart:
        extra = self.model_extra or {}
        _unicode_within(extra)
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs 'text'")
        if self.type == "text" and extra:  # OpenAI's text part has no other key
            raise ValueError(f"a text part has only 'type' and 'text', not {', '.join(extra)}")
        return self


def _content(value: Any) -> str | list[ContentPart] | None:
    """A message's content: a string, a non-empty list of content parts, or null (one error
    naming ``content`` for anything else, not one per alternative)."""
    if value is None or isinstance(value, str):
        return value if value is None else _unicode(value)
    if isinstance(value, list) and len(value) > MAX_PARTS:  # counted before any part is read
        raise ValueError(f"at most {MAX_PARTS} content parts per message")
    if isinstance(value, list) and value:
        return [ContentPart.model_validate(part) for part in value]
    raise ValueError("must be a string, a non-empty list of content parts, or null")


class FunctionCall(_Request):
    """An assistant message's deprecated ``function_call``: OpenAI's schema requires both
    fields (an empty one reached the engine's tokenizer, which refused it: a 502)."""

    name: Text
    arguments: Text


class FunctionDefinition(_Request):
    """OpenAI's ``FunctionObject``: what a function tool tells the model."""

    name: ToolName
    description: Text | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class ChatTool(_Request):
    """One of a chat request's ``tools`` (OpenAI's ``ChatCompletionTool``)."""

    type: Literal["function"]
    function: FunctionDefinition


class CalledFunction(_Request):
    name: ToolName
    arguments: Text


class ToolCall(_Request):
    """One of an assistant message's ``tool_calls`` (``ChatCompletionMessageToolCall``)."""

    id: Text = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


def _each(model: type[BaseModel], what: str) -> Any:
    """A validator of a passed-on list: every item must read as ``model`` (a 400 naming the
    item, not an engine's refusal of its tokenizer: a 502); the items go on as the client sent
    them. Only function tools are served: other tools run code or reach third parties on the
    engine's side, and their outputs are not text the gateway can screen."""

    def check(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if len(items) > MAX_TOOLS:
            raise ValueError(f"at most {MAX_TOOLS} {what}s")
        for position, item in enumerate(items):
            kind = item.get("type", "function")
            if kind != "function":
                raise ValueError(
                    f"{what} {position}: the gateway serves function tools only, "
                    f"not {str(kind)[:64]!r}"
                )
            try:
                validated(model, item)
            except ValueError as exc:
                raise ValueError(f"{what} {position}: {exc}") from None
        return items

    return AfterValidator(check)


# counted before anything else (a constraint on the field would come after the validators: a
# list of 1M tools was walked for 1.1 s before its count refused it)
ToolObjects = Annotated[
    list[dict[str, Any]], Field(max_length=MAX_TOOLS), AfterValidator(_unicode_within)
]
Tools = Annotated[ToolObjects, _each(ChatTool, "tool")]
ToolCalls = Annotated[ToolObjects, _each(ToolCall, "tool call")]


class ChatMessage(_Request):
    role: Literal["developer", "system", "user", "assistant", "tool", "function"]
    content: Annotated[Any, AfterValidator(_content)] = None
    name: Text | None = Field(default=None, max_length=64)
    tool_calls: ToolCalls | None = None
    tool_call_id: Text | None = Field(default=None, max_length=256)
    refusal: Text | None = None
    audio: JsonObject | None = None
    function_call: FunctionCall | None = None

    @model_validator(mode="after")
    def _check_content(self) -> ChatMessage:
        if self.content is None and self.role not in ("assistant", "function"):
            raise ValueError(f"a {self.role} message needs content")
        if self.tool_call_id is None and self.role == "tool":
            raise ValueError("a tool message needs tool_call_id")
        return self

    def part_types(self) -> set[str]:
        return {p.type for p in self.content} if isinstance(self.content, list) else set()

    def __repr__(self) -> str:
        size = len(self.content) if isinstance(self.content, str | list) else 0
        return f"ChatMessage(role={self.role!r}, content=<{size} chars or parts>)"

    __str__ = __repr__


class _Sampling(_Request):
    """The fields chat completions and completions share."""

    model: StoredText = Field(min_length=1, max_length=256)  # in every audit row
    max_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CEILING)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None
    stop: Text | list[Text] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    user: Text | None = Field(default=None, max_length=256)
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    logit_bias: dict[Text, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        default=None, max_length=1024
    )
    # vLLM/SGLang's prefix-cache salt: accepted for compatibility, never forwarded (the gateway
    # sets its own per tenant, gateway.engines.isolation)
    cache_salt: Text | None = Field(default=None, max_length=1024)

    @field_validator("stop", mode="before")
    @classmethod
    def _count_stops(cls, value: Any) -> Any:
        """The count before the items: an 8 MiB list of 1.4M stops was read one by one (0.19 s)
        before its count refused it."""
        if isinstance(value, list) and len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences")
        return value

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
    def _check_stream_options(self) -> _Sampling:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def choices(self) -> int:
        return self.n or 1

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def max_tokens_param(self) -> str | None:
        """The parameter that set the completion's size, as the client named it (None: unset)."""
        return "max_tokens" if self.max_tokens is not None else None

    def wants_usage_chunk(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def upstream_body(self, *, max_tokens: int) -> dict[str, Any]:
        """What the engine receives: the client's fields, the enforced max_tokens, usage on
        (``gateway.openai.surface.for_engine`` then drops what the chosen engine does not take)."""
        body = self.model_dump(exclude_unset=True, exclude={"max_completion_tokens", "cache_salt"})
        body["max_tokens"] = max_tokens
        if self.stream:
            body["stream_options"] = {"include_usage": True}  # the gateway needs the counts
        return body


class ChatCompletionBody(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_TOKENS_CEILING)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Tools | None = None
    tool_choice: Literal["none", "auto", "required"] | JsonObject | None = None
    parallel_tool_calls: bool | None = None
    functions: ToolObjects | None = None
    function_call: Literal["none", "auto"] | JsonObject | None = None
    response_format: JsonObject | None = None
    metadata: dict[Text, Text] | None = Field(default=None, max_length=16)
    store: bool | None = None
    service_tier: Text | None = None
    modalities: list[Text] | None = Field(default=None, max_length=MAX_MODALITIES)
    audio: JsonObject | None = None
    prediction: JsonObject | None = None
    web_search_options: JsonObject | None = None
    reasoning_effort: Text | None = None
    verbosity: Text | None = None
    safety_identifier: Text | None = Field(default=None, max_length=256)
    prompt_cache_key: Text | None = None
    prompt_cache_options: Json | None = None
    prompt_cache_retention: Text | None = None
    moderation: Json | None = None

    @field_validator("messages", mode="before")
    @classmethod
    def _count_parts(cls, value: Any) -> Any:
        """All messages' content parts together, counted before any message is read."""
        if isinstance(value, list) and len(value) <= MAX_MESSAGES:  # more: refused on that count
            check_part_count(
                message.get("content") for message in value if isinstance(message, dict)
            )
        return value

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionBody:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.response_format is not None and not isinstance(
            self.response_format.get("type"), str
        ):
            raise ValueError("response_format needs a 'type'")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            # as OpenAI refuses it; engines refuse it too, SGLang already when counting the prompt
            raise ValueError("tool_choice 'required' or a named function needs tools")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def max_tokens_param(self) -> str | None:
        if self.max_tokens is not None:
            return "max_tokens"
        return "max_completion_tokens" if self.max_completion_tokens is not None else None

    def token_input(self) -> tuple[str | None, list[dict[str, Any]] | None]:
        return None, [m.model_dump(exclude_none=True) for m in self.messages]


class CompletionBody(_Sampling):
    # one check of the whole value after the union: its error names ``prompt``, not a member
    prompt: Annotated[Text | list[Any], AfterValidator(_unicode_within)] = Field(min_length=1)
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool | None = None
    suffix: Text | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None

    def __repr__(self) -> str:
        return f"CompletionBody(model={self.model!r}, prompt=<{len(self.prompt)} chars>)"

    def token_input(self) -> tuple[str | None, list[dict[str, Any]] | None]:
        return (self.prompt if isinstance(self.prompt, str) else None), None


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's CreateEmbeddingRequest: any input array has at most 2048
EMBEDDING_SPECIAL_TOKENS = 4  # per input: what an embedding model's tokenizer may add (CLS/SEP)
_INPUT_SHAPE = (
    "must be a non-empty string, or a non-empty array (at most 2048 items) of non-empty strings, "
    "of token ids, or of non-empty token-id arrays"
)


def _token_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in value)
    )


def _embedding_input(value: Any) -> str | list[str] | list[int] | list[list[int]]:
    """``input`` as OpenAI's schema has it (one error naming ``input`` for anything else)."""
    if isinstance(value, str) and value:
        return _unicode(value)
    if not isinstance(value, list) or not 1 <= len(value) <= MAX_EMBEDDING_INPUTS:
        raise ValueError(_INPUT_SHAPE)
    if all(isinstance(item, str) and item for item in value):
        return [_unicode(item) for item in value]
    if _token_ids(value) or all(_token_ids(item) for item in value):
        return value
    raise ValueError(_INPUT_SHAPE)


class EmbeddingsBody(_Request):
    """OpenAI's ``CreateEmbeddingRequest`` (``additionalProperties: false``)."""

    model: StoredText = Field(min_length=1, max_length=256)
    input: Annotated[Any, AfterValidator(_embedding_input)]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Field(ge=1, le=1 << 16)] | None = None
    user: Text | None = Field(default=None, max_length=256)

    def __repr__(self) -> str:
        return f"EmbeddingsBody(model={self.model!r}, input=<{self.input_count()} inputs>)"

    __str__ = __repr__

    def inputs(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str) or _token_ids(value):
            return [value]
        return list(value)

    def input_count(self) -> int:
        return len(self.inputs())

    def token_bound(self) -> int:
        """At most this many tokens: a tokenizer makes at most one token of each UTF-8 byte
        (byte-level BPE, SentencePiece with byte fallback, WordPiece), plus the special tokens it
        adds per input; a token-id array is its length. What the tenant's tokens per minute are
        charged at admission; the engine's ``usage.prompt_tokens`` settles it (the rest comes
        back)."""
        return sum(
            (len(item.encode("utf-8")) if isinstance(item, str) else len(item))
            + EMBEDDING_SPECIAL_TOKENS
            for item in self.inputs()
        )

    def upstream_body(self) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True)
