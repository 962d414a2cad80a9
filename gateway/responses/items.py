"""A request's input as the items the gateway stores and lists (``GET .../input_items``), after
OpenAI's published ``ItemResource``: every item with an id (``msg_``, ``fc_``, ``fco_``, ``rs_``
and 48 random hex digits when the client gave none) and a status; a message's text as parts
(``input_text`` for the client's roles, ``output_text`` for an assistant's). ``page`` is one page
of a ``ResponseItemList``. Pure: no I/O.
"""

from __future__ import annotations

from typing import Any, Literal

from gateway.responses.objects import new_id
from gateway.responses.schemas import (
    CreateResponseBody,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItem,
    MessageItem,
    ReasoningItem,
)

MAX_PAGE = 100


def stored_input(body: CreateResponseBody) -> list[dict[str, Any]]:
    """This request's input items, as stored."""
    return [_stored(item) for item in body.items()]


def _stored(item: InputItem) -> dict[str, Any]:
    if isinstance(item, MessageItem):
        return _message(item)
    if isinstance(item, FunctionCallItem):
        call = item.model_dump(exclude_none=True)
        return {**call, "id": item.id or new_id("fc"), "status": item.status or "completed"}
    if isinstance(item, FunctionCallOutputItem):
        output = item.model_dump(exclude_none=True)
        return {**output, "id": item.id or new_id("fco"), "status": item.status or "completed"}
    if isinstance(item, ReasoningItem):
        reasoning = item.model_dump(exclude_none=True)
        return {**reasoning, "id": item.id or new_id("rs")}
    raise ValueError(f"an {type(item).__name__} is not stored")  # refused by the surface


def _message(item: MessageItem) -> dict[str, Any]:
    assistant = item.role == "assistant"
    if isinstance(item.content, str):
        parts = [_text_part(item.content, assistant=assistant)]
    else:
        parts = []
        for part in item.parts():
            dumped = part.model_dump(exclude_none=True)
            if part.type in ("input_text", "output_text"):
                dumped = _text_part(part.text, assistant=assistant)
            parts.append(dumped)
    message: dict[str, Any] = {
        "id": item.id or new_id("msg"),
        "type": "message",
        "role": item.role,
        "status": item.status or "completed",
        "content": parts,
    }
    return message


def _text_part(text: str, *, assistant: bool) -> dict[str, Any]:
    if assistant:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "input_text", "text": text}


def page(
    items: list[dict[str, Any]],
    *,
    limit: int = 20,
    after: str | None = None,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    """One page of a ``ResponseItemList`` (``order`` "desc": newest first, as OpenAI's default);
    ``after`` an item id of the previous page (an unknown one starts at the beginning)."""
    ordered = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [item.get("id") for item in ordered]
        start = ids.index(after) + 1 if after in ids else 0
    limit = max(1, min(limit, MAX_PAGE))
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else "",
        "last_id": data[-1]["id"] if data else "",
        "has_more": start + limit < len(ordered),
    }
