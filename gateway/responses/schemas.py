"""The body of ``POST /v1/responses`` the gateway accepts (HTTP edge), after OpenAI's published
``CreateResponse`` schema and what it references.

Every field of ``CreateResponse`` is declared, so a request any OpenAI client may send is read,
not refused as unknown; what each engine kind does with each field is decided in one place,
``gateway.responses.surface``. Unknown fields, wrong JSON types and out-of-range numbers are 400s
naming the field (the same base and text types as chat: ``gateway.openai.schemas``).

``input`` is a string or a list of items, each read by its ``type`` (a message may leave it out):
messages (``input_text``, ``input_image``, ``input_file`` parts; an assistant's ``output_text``
and ``refusal`` parts), ``function_call``, ``function_call_output``, ``reasoning`` and
``item_reference``; two items with one id are a 400, as OpenAI answers. Any other item type is a
400 naming it, as is any tool that is not a function: the gateway serves function tools only
(built-in tools run code or reach third parties on the engine's side, and their outputs are not
text the gateway can screen).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal, get_args

from pydantic import AfterValidator, Field, model_validator

from contracts.openai import check_passed_on
from gateway.db.text import StoredText
from gateway.openai.schemas import (
    MAX_MESSAGES,
    MAX_PARTS,
    MAX_TOKENS_CEILING,
    MAX_TOOLS,
    Json,
    JsonObject,
    JsonObjects,
    Text,
    ToolName,
    _Request,
    check_part_count,
    validated,
)

MAX_ITEMS = MAX_MESSAGES  # input items (as chat's messages)
MIN_OUTPUT_TOKENS = 16  # CreateResponse.max_output_tokens: "minimum: 16"
Include = Literal[  # IncludeEnum
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]
INCLUDE_VALUES: tuple[str, ...] = get_args(Include)
Status = Literal["in_progress", "completed", "incomplete"]


# -- content parts ----------------------------------------------------------------------------


class InputText(_Request):
    type: Literal["input_text"]
    text: Text
    prompt_cache_breakpoint: Json | None = None


class InputImage(_Request):
    type: Literal["input_image"]
    image_url: Text | None = None
    file_id: Text | None = None
    detail: Literal["low", "high", "auto", "original"] | None = None
    prompt_cache_breakpoint: Json | None = None

    @model_validator(mode="after")
    def _source(self) -> InputImage:
        if (self.image_url is None) == (self.file_id is None):
            raise ValueError("an input_image needs exactly one of image_url and file_id")
        return self


class InputFile(_Request):
    type: Literal["input_file"]
    file_id: Text | None = None
    file_data: Text | None = None
    file_url: Text | None = None
    filename: Text | None = None
    detail: Text | None = None
    prompt_cache_breakpoint: Json | None = None


class OutputText(_Request):
    type: Literal["output_text"]
    text: Text
    annotations: JsonObjects | None = None
    logprobs: JsonObjects | None = None


class RefusalPart(_Request):
    type: Literal["refusal"]
    refusal: Text


Part = InputText | InputImage | InputFile | OutputText | RefusalPart
_PARTS: dict[str, type[_Request]] = {
    "input_text": InputText,
    "input_image": InputImage,
    "input_file": InputFile,
    "output_text": OutputText,
    "refusal": RefusalPart,
}
_INPUT_PARTS = frozenset({"input_text", "input_image", "input_file"})
_ASSISTANT_PARTS = frozenset({"input_text", "output_text", "refusal"})


def _dispatch(table: dict[str, type[_Request]], value: Any, what: str) -> Any:
    """One object read by its ``type``: a ValueError naming the type, or the first problem of
    the model it names, with its place (``content.0.text: ...``)."""
    if not isinstance(value, dict):
        raise ValueError(f"each {what} must be an object")
    kind = value.get("type")
    model = table.get(kind) if isinstance(kind, str) else None
    if model is None:
        served = ", ".join(table)
        raise ValueError(f"{what} type {str(kind)[:64]!r} is not supported (served: {served})")
    return validated(model, value)


def _parts(value: Any) -> str | list[Part]:
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value or len(value) > MAX_PARTS:
        raise ValueError(f"content must be a string or a list of 1 to {MAX_PARTS} parts")
    parts = []
    for position, part in enumerate(value):
        try:
            parts.append(_dispatch(_PARTS, part, "content part"))
        except ValueError as exc:
            raise ValueError(f"content part {position}: {exc}") from None
    return parts


# -- input items ------------------------------------------------------------------------------


class MessageItem(_Request):
    """``EasyInputMessage``, ``InputMessage`` or an echoed ``OutputMessage``."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Annotated[Any, AfterValidator(_parts)]
    id: Text | None = Field(default=None, max_length=256)
    status: Status | None = None
    phase: Literal["commentary", "final_answer"] | None = None

    @model_validator(mode="after")
    def _roles(self) -> MessageItem:
        allowed = _ASSISTANT_PARTS if self.role == "assistant" else _INPUT_PARTS
        for position, part in enumerate(self.parts()):
            if part.type not in allowed:
                raise ValueError(
                    f"content part {position}: a {self.role} message has no {part.type} parts"
                )
        return self

    def parts(self) -> list[Part]:
        return self.content if isinstance(self.content, list) else []

    def __repr__(self) -> str:
        return f"MessageItem(role={self.role!r}, content=<{len(self.content)} chars or parts>)"

    __str__ = __repr__


class FunctionCallItem(_Request):
    type: Literal["function_call"]
    call_id: Text = Field(min_length=1, max_length=256)
    name: ToolName
    arguments: Text
    id: Text | None = Field(default=None, max_length=256)
    status: Status | None = None
    namespace: Text | None = Field(default=None, max_length=64)
    caller: Json | None = None


class FunctionCallOutputItem(_Request):
    type: Literal["function_call_output"]
    call_id: Text = Field(min_length=1, max_length=256)
    output: Annotated[Any, AfterValidator(_parts)]
    id: Text | None = Field(default=None, max_length=256)
    status: Status | None = None
    name: Text | None = Field(default=None, max_length=128)
    namespace: Text | None = Field(default=None, max_length=64)
    caller: Json | None = None

    @model_validator(mode="after")
    def _output_parts(self) -> FunctionCallOutputItem:
        if isinstance(self.output, list) and any(p.type not in _INPUT_PARTS for p in self.output):
            raise ValueError("output parts are input_text, input_image or input_file")
        return self


class SummaryText(_Request):
    type: Literal["summary_text"]
    text: Text


class ReasoningText(_Request):
    type: Literal["reasoning_text"]
    text: Text


class ReasoningItem(_Request):
    type: Literal["reasoning"]
    id: Text | None = Field(default=None, max_length=256)
    summary: list[SummaryText] = Field(default_factory=list, max_length=MAX_PARTS)
    content: list[ReasoningText] | None = Field(default=None, max_length=MAX_PARTS)
    encrypted_content: Text | None = None
    status: Status | None = None


class ItemReference(_Request):
    type: Literal["item_reference"] | None = None
    id: Text = Field(min_length=1, max_length=256)


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | ItemReference
_ITEMS: dict[str, type[_Request]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
    "item_reference": ItemReference,
}


def _contents(items: list[Any]) -> Iterator[Any]:
    """Every list of parts of the input items as sent (a message's content, a function call
    output's output, a reasoning item's summary and content), none of them read."""
    for item in items:
        if isinstance(item, dict):
            for name in ("content", "output", "summary"):
                yield item.get(name)


def read_item(value: Any) -> Any:
    """One input item, read by its type (a stored item too)."""
    if isinstance(value, dict) and value.get("type") is None:  # a type-less message/reference
        return validated(MessageItem if "role" in value else ItemReference, value)
    return _dispatch(_ITEMS, value, "input item")


def _input(value: Any) -> str | list[InputItem]:
    listed = isinstance(value, list) and 0 < len(value) <= MAX_ITEMS
    if not listed and not isinstance(value, str):
        raise ValueError(f"must be a string or a list of 1 to {MAX_ITEMS} items")
    if listed:  # the counts before any walk
        check_part_count(_contents(value))
    check_passed_on(value)  # every string of every item, and the depth, in one walk
    if isinstance(value, str):
        return value
    items = []
    ids: set[str] = set()
    for position, item in enumerate(value):
        try:
            items.append(read_item(item))
        except ValueError as exc:
            raise ValueError(f"item {position}: {exc}") from None
        item_id = items[-1].id
        if item_id in ids:  # OpenAI's refusal; a listing's ``after`` names one item
            raise ValueError(
                f"Duplicate item found with id {item_id}. Remove duplicate items from "
                "your input and try again."
            )
        if item_id is not None:
            ids.add(item_id)
    return items


# -- tools, tool choice, text format, reasoning ------------------------------------------------


class FunctionTool(_Request):
    type: Literal["function"]
    name: ToolName
    description: Text | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None
    defer_loading: bool | None = None
    output_schema: JsonObject | None = None
    allowed_callers: JsonObjects | None = None


def _tools(value: Any) -> list[FunctionTool]:
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise ValueError(f"must be a list of at most {MAX_TOOLS} tools")
    tools: list[FunctionTool] = []
    for position, tool in enumerate(value):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValueError(
                f"tool {position}: the gateway serves function tools only, not {str(kind)[:64]!r}"
            )
        try:
            tools.append(validated(FunctionTool, tool))
        except ValueError as exc:
            raise ValueError(f"tool {position}: {exc}") from None
    return tools


class NamedFunction(_Request):
    type: Literal["function"]
    name: ToolName


class AllowedTools(_Request):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: JsonObjects = Field(min_length=1, max_length=128)


def _tool_choice(value: Any) -> str | NamedFunction | AllowedTools:
    if value in ("none", "auto", "required"):
        return str(value)
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "function":
        return validated(NamedFunction, value)
    if kind == "allowed_tools":
        return validated(AllowedTools, value)
    raise ValueError(
        "must be 'none', 'auto', 'required', a function ({'type': 'function', 'name': ...}) or "
        f"allowed_tools; the gateway serves function tools only, not {str(kind)[:64]!r}"
    )


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = Field(default=None, min_length=1, max_length=64)
    schema_: JsonObject | None = Field(default=None, alias="schema")
    description: Text | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _json_schema(self) -> TextFormat:
        schema_fields = {"name", "schema_", "description", "strict"} & self.model_fields_set
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs 'name' and 'schema'")
        if self.type != "json_schema" and schema_fields:
            raise ValueError(f"a {self.type} format has only 'type'")
        return self


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Request):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: Text | None = None


class ConversationRef(_Request):
    id: Text = Field(min_length=1, max_length=256)


class ResponseStreamOptions(_Request):
    include_obfuscation: bool | None = None


# -- the body ---------------------------------------------------------------------------------


class CreateResponseBody(_Request):
    """``POST /v1/responses``. ``model_fields_set`` is what the client gave (nulls are not)."""

    model: StoredText = Field(min_length=1, max_length=256)  # in every audit row
    input: Annotated[Any, AfterValidator(_input)]
    instructions: Text | None = None
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    max_output_tokens: Annotated[int, Field(ge=MIN_OUTPUT_TOKENS, le=MAX_TOKENS_CEILING)] | None = (
        None
    )
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Annotated[Any, AfterValidator(_tools)] | None = None
    tool_choice: Annotated[Any, AfterValidator(_tool_choice)] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: Annotated[int, Field(ge=1, le=1024)] | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[Include] | None = Field(default=None, max_length=16)
    metadata: dict[Text, Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16
    )
    store: bool | None = None
    previous_response_id: Text | None = Field(default=None, min_length=1, max_length=256)
    conversation: Text | ConversationRef | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: (
        Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None
    ) = None
    user: Text | None = Field(default=None, max_length=256)
    safety_identifier: Text | None = Field(default=None, max_length=64)
    prompt: JsonObject | None = None
    prompt_cache_key: Text | None = Field(default=None, max_length=1024)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: JsonObject | None = None
    moderation: JsonObject | None = None
    context_management: JsonObjects | None = Field(default=None, min_length=1, max_length=16)

    @model_validator(mode="after")
    def _consistent(self) -> CreateResponseBody:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.previous_response_id is not None and self.conversation is not None:
            raise ValueError("give previous_response_id or conversation, not both")
        names = {tool.name for tool in self.function_tools()}
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice 'required' or a named function needs tools")
        if isinstance(choice, NamedFunction) and choice.name not in names:
            raise ValueError(f"tool_choice names '{choice.name[:64]}', which is not in tools")
        if self.metadata is not None and any(len(key) > 64 for key in self.metadata):
            raise ValueError("metadata keys are at most 64 characters")
        return self

    @property
    def stores(self) -> bool:
        """Whether the gateway keeps this response (OpenAI's default: ``store`` true)."""
        return self.store is not False

    def function_tools(self) -> list[FunctionTool]:
        return list(self.tools or [])

    def items(self) -> list[InputItem]:
        """The input as items: a string is one user message."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def __repr__(self) -> str:
        size = len(self.input)
        return f"CreateResponseBody(model={self.model!r}, input=<{size} chars or items>)"

    __str__ = __repr__
