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
"""

from __future__ import annotations

from typing import Any

from gateway.api.surface import Profile
from gateway.responses.schemas import CreateResponseBody
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
