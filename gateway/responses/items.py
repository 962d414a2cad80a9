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
    ``after`` an item id of the previous page (an unknown one starts at the beginning).

    ``after`` finds the first item with its id, so a page ends on such an item: a turn stored
    with a client's id repeated (refused since) is still listed whole, each item once, where a
    page ending on a repeat would send the next request back to the first (and on forever)."""
    ordered = items if order == "asc" else items[::-1]
    ids = [item.get("id") for item in ordered]
    first: dict[Any, int] = {}
    for position, item_id in enumerate(ids):
        first.setdefault(item_id, position)
    start = first[after] + 1 if after is not None and after in first else 0
    end = _end(ids, first, start, start + max(1, min(limit, MAX_PAGE)))
    data = ordered[start:end]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else "",
        "last_id": data[-1]["id"] if data else "",
        "has_more": end < len(ordered),
    }


def _end(ids: list[Any], first: dict[Any, int], start: int, end: int) -> int:
    """Where the page from ``start`` ends: the furthest end up to ``end`` after the first item
    of its id, or the end of the list; a page that starts on a run of repeats runs past ``end``
    to the first such end (no shorter page can end on an item ``after`` finds again)."""

    def resumable(stop: int) -> bool:
        return stop >= len(ids) or first[ids[stop - 1]] == stop - 1

    end = min(end, len(ids))
    shorter = next((stop for stop in range(end, start, -1) if resumable(stop)), None)
    if shorter is not None:
        return shorter
    while not resumable(end):
        end += 1
    return end
