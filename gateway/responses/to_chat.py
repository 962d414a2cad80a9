"""A Responses request, with the tenant's stored conversation before it, as a chat completion
request: what an engine without ``/v1/responses`` receives, and the messages the gateway counts
for every engine -- but for a conversation holding ``reasoning`` items that a native engine may
serve: those it counts with each such item as an assistant message
(``gateway.responses.passthrough.reasoning_as_messages``), since a native engine reads them.

The conversation is ``instructions`` (a system message; never carried over from earlier turns, as
OpenAI documents), then the stored items of the ``previous_response_id`` chain (their input and
output), then this request's input. Items become messages as vLLM 0.33.0 renders them for its
own chat template (``entrypoints/openai/responses/utils.py`` ``construct_input_messages``):

- a message: its role and text (parts joined when all are text; an image or file keeps its parts);
- a ``function_call``: an assistant message with that tool call, merged into the assistant
  message before it, so parallel calls stay one turn;
- a ``function_call_output``: a ``tool`` message for its ``call_id``;
- a ``reasoning`` item: left out (chat templates drop earlier turns' reasoning; the surface says
  so: "accepted, not forwarded");
- an ``item_reference``: refused earlier by the surface (``gateway.responses.surface``).

Fields map to their chat names: ``tools`` (``{"type": "function", "function": {...}}``),
``tool_choice``, ``text.format`` -> ``response_format``, ``reasoning.effort`` ->
``reasoning_effort``, ``max_output_tokens`` -> ``max_completion_tokens``, and the sampling fields as
they are. Fields the gateway keeps (``store``, ``previous_response_id``, ``metadata``) never
reach an engine. The result is validated as the gateway's own ``ChatCompletionBody``, so the chat
path (admission, counting, surface, hooks) takes it as it takes any chat request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from gateway.openai.schemas import ChatCompletionBody
from gateway.responses.schemas import (
    CreateResponseBody,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    NamedFunction,
    Part,
    ReasoningItem,
    read_item,
)

_SAMPLING = ("temperature", "top_p", "user", "safety_identifier", "parallel_tool_calls", "stream")


class UnreadableHistory(ValueError):
    """A stored item that does not read back as input: kept before the gateway checked what an
    engine writes (``objects.check_call``), so its chain cannot be continued (a 400 naming
    ``previous_response_id``)."""


def chat_messages(
    body: CreateResponseBody, history: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The whole conversation as chat messages: instructions, the stored ``history`` items (dicts
    as stored: earlier turns' input and output), this request's input."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    for position, stored in enumerate(history or ()):
        try:
            item = _stored(stored)
        except ValueError as exc:
            raise UnreadableHistory(f"stored item {position}: {exc}") from None
        _append(messages, item)
    for item in body.items():
        _append(messages, item)
    return messages


def chat_body(
    body: CreateResponseBody, history: list[dict[str, Any]] | None = None
) -> ChatCompletionBody:
    """The chat completion request for an engine without ``/v1/responses``."""
    fields: dict[str, Any] = {"model": body.model, "messages": chat_messages(body, history)}
    for name in _SAMPLING:
        if name in body.model_fields_set:
            fields[name] = getattr(body, name)
    if body.max_output_tokens is not None:
        fields["max_completion_tokens"] = body.max_output_tokens
    if body.tools:
        fields["tools"] = [_tool(tool.model_dump(exclude_none=True)) for tool in body.tools]
    if body.tool_choice is not None and body.tools:  # without tools, no choice asks anything
        fields["tool_choice"] = _tool_choice(body.tool_choice)
    text_format = body.text.format if body.text else None
    if text_format is not None and text_format.type != "text":
        fields["response_format"] = _response_format(text_format.model_dump(by_alias=True))
    if body.reasoning is not None and body.reasoning.effort is not None:
        fields["reasoning_effort"] = body.reasoning.effort
    if body.service_tier is not None:
        fields["service_tier"] = body.service_tier
    return ChatCompletionBody.model_validate(fields)


def _stored(item: dict[str, Any]) -> InputItem:
    """A stored item (an earlier input item or output item, as the gateway wrote it)."""
    kind = item.get("type")
    if kind == "message" and item.get("role") == "assistant":
        parts = [p for p in item.get("content", []) if p.get("type") in ("output_text", "refusal")]
        item = {"type": "message", "role": "assistant", "content": parts or ""}
    elif kind == "function_call":
        keep = ("type", "call_id", "name", "arguments")
        item = {k: item[k] for k in keep if k in item}
    elif kind == "reasoning":
        item = {"type": "reasoning", "summary": [], "content": item.get("content") or []}
    parsed: InputItem = read_item(item)
    return parsed


def _append(messages: list[dict[str, Any]], item: InputItem) -> None:
    if isinstance(item, ReasoningItem):
        return
    if isinstance(item, FunctionCallItem):
        call = {
            "id": item.call_id,
            "type": "function",
            "function": {"name": item.name, "arguments": item.arguments},
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return
    if isinstance(item, FunctionCallOutputItem):
        content = item.output if isinstance(item.output, str) else _content(item.output)
        messages.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
        return
    if isinstance(item, MessageItem):
        messages.append(_message(item))
        return
    raise ValueError(f"no chat form for a {type(item).__name__}")  # refused by the surface


def _message(item: MessageItem) -> dict[str, Any]:
    if isinstance(item.content, str):
        return {"role": item.role, "content": item.content}
    refusals = [p.refusal for p in item.parts() if p.type == "refusal"]
    parts = [p for p in item.parts() if p.type != "refusal"]
    message: dict[str, Any] = {"role": item.role, "content": _content(parts) if parts else None}
    if refusals:
        message["refusal"] = "".join(refusals)
    return message


def _content(parts: Sequence[Part]) -> str | list[dict[str, Any]]:
    """Parts as chat content: one string when all are text, else chat's content parts."""
    if all(p.type in ("input_text", "output_text") for p in parts):
        return "".join(p.text for p in parts if p.type in ("input_text", "output_text"))
    out: list[dict[str, Any]] = []
    for part in parts:
        if part.type in ("input_text", "output_text"):
            out.append({"type": "text", "text": part.text})
        elif part.type == "input_image":
            image = {"url": part.image_url or ""}
            if part.detail in ("low", "high", "auto"):
                image["detail"] = part.detail
            out.append({"type": "image_url", "image_url": image})
        elif part.type == "input_file":
            file = {
                k: v for k, v in (("file_data", part.file_data), ("filename", part.filename)) if v
            }
            out.append({"type": "file", "file": file})
    return out


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, NamedFunction):
        return {"type": "function", "function": {"name": choice.name}}
    if isinstance(choice, str):
        return choice
    mode_tools = choice.model_dump()
    return {
        "type": "allowed_tools",
        "allowed_tools": {"mode": mode_tools["mode"], "tools": mode_tools["tools"]},
    }


def _response_format(text_format: dict[str, Any]) -> dict[str, Any]:
    if text_format["type"] == "json_object":
        return {"type": "json_object"}
    schema = {
        k: text_format[k]
        for k in ("name", "schema", "description", "strict")
        if text_format.get(k) is not None
    }
    return {"type": "json_schema", "json_schema": schema}
