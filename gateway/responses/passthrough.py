"""The request an engine that serves ``/v1/responses`` itself receives (SGLang, vLLM).

The client's fields that engine takes (``gateway.responses.surface``: forwarded), with three
rules of the gateway's own that no client value changes:

- the whole conversation is sent: the stored items of the tenant's ``previous_response_id`` chain,
  then this request's input; never ``previous_response_id`` or ``conversation`` (an engine's own
  store is keyed by response id alone -- vLLM 0.33.0 keeps it in a process dict,
  ``entrypoints/openai/responses/serving.py`` ``response_store``, SGLang 0.5.23 likewise
  (``serving_responses.py``, behind ``--enable-response-store``) -- so an id forwarded from one
  tenant could continue, and read, another's conversation);
- ``store`` is false and ``background`` absent: the engine keeps nothing;
- ``max_output_tokens`` is the limit the gateway enforced.

Such an engine reads the conversation's ``reasoning`` items too (vLLM 0.33.0
``entrypoints/openai/responses/utils.py`` ``_construct_message_from_response_item``: an assistant
message's ``reasoning``, rendered or dropped by the model's chat template), which the chat form
leaves out (``gateway.responses.to_chat``). ``reasoning_as_messages`` gives admission the
conversation with each of them as an assistant message of all its texts, so that what a native
engine reads is counted, limited and screened by the request hooks like any message.
"""

from __future__ import annotations

from typing import Any

from gateway.openai.surface import Profile
from gateway.responses.schemas import CreateResponseBody, InputItem, ReasoningItem, read_item
from gateway.responses.surface import RULES, forwarded

NEVER_SENT = ("previous_response_id", "conversation", "background", "store")
_SUB_ROWS = {"text": ("format", "verbosity"), "reasoning": ("effort", "summary", "context")}


def native_body(
    body: CreateResponseBody,
    *,
    history: list[dict[str, Any]],
    max_output_tokens: int,
    profile: Profile,
) -> dict[str, Any]:
    """The upstream body for a native engine of ``profile``: ``history`` is the stored items of
    the conversation so far (input and output of each earlier turn, oldest first)."""
    sent = body.model_dump(exclude_unset=True, exclude_none=True, by_alias=True, mode="json")
    out: dict[str, Any] = {}
    for name, value in sent.items():
        if name in _SUB_ROWS:
            kept = _sub_fields(name, value, profile)
            if kept:
                out[name] = kept
        elif name in RULES and forwarded(name, profile):
            out[name] = value
    this_turn = sent["input"]
    if isinstance(this_turn, str):
        this_turn = [{"type": "message", "role": "user", "content": this_turn}]
    out["input"] = [*history, *this_turn] if history else sent["input"]
    for name in NEVER_SENT:
        out.pop(name, None)
    out["store"] = False
    out["max_output_tokens"] = max_output_tokens
    return out


def _sub_fields(name: str, value: dict[str, Any], profile: Profile) -> dict[str, Any]:
    """``text`` or ``reasoning``: the members whose rows this engine forwards (``summary``
    stands for ``generate_summary`` too; ``context`` for ``mode``)."""
    rows = {"generate_summary": "summary", "mode": "context"}
    kept = {}
    for member, member_value in value.items():
        row = f"{name}.{rows.get(member, member)}"
        if row in RULES and forwarded(row, profile):
            kept[member] = member_value
    return kept


def reasoning_as_messages(
    body: CreateResponseBody, history: list[dict[str, Any]]
) -> tuple[CreateResponseBody, list[dict[str, Any]]] | None:
    """The request and its stored ``history`` with every ``reasoning`` item as an assistant
    message (``_as_message``), or None when the conversation has none."""
    items = body.items()
    if not any(isinstance(item, ReasoningItem) for item in items) and not any(
        stored.get("type") == "reasoning" for stored in history
    ):
        return None
    read: list[InputItem] = [
        read_item(_as_message(item.model_dump(exclude_none=True)))
        if isinstance(item, ReasoningItem)
        else item
        for item in items
    ]
    turned = [
        _as_message(stored) if stored.get("type") == "reasoning" else stored for stored in history
    ]
    return body.model_copy(update={"input": read}), turned


def _as_message(reasoning: dict[str, Any]) -> dict[str, Any]:
    """A reasoning item (as sent or stored) as an assistant message of every text it holds, its
    content then its summary: vLLM reads the first of them, so the text counted holds at least
    what it reads (the few tokens a template may put around reasoning are not added); an item
    without text is still a turn, an empty one."""
    texts = [
        part["text"]
        for key in ("content", "summary")
        for part in reasoning.get(key) or ()
        if isinstance(part, dict) and isinstance(part.get("text"), str)
    ]
    text = {"type": "output_text", "text": "\n".join(texts)}
    return {"type": "message", "role": "assistant", "content": [text]}
