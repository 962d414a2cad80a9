"""Which Responses request fields each engine kind serves: the Responses API's one place of
decision, beside chat's (``gateway.openai.surface``, whose profiles, decisions and 400 it shares).

Two ways an engine serves ``POST /v1/responses``:

- *native* (SGLang, vLLM): the engine serves ``/v1/responses`` itself; the gateway passes the
  request on (``gateway.responses.passthrough``). The cells follow what those servers read:
  SGLang 0.5.23 ``python/sglang/srt/entrypoints/openai/protocol.py`` ``ResponsesRequest`` and
  ``serving_responses.py``; vLLM 0.33.0 ``entrypoints/openai/responses/protocol.py``
  ``ResponsesRequest`` and ``serving.py`` (the release that moved ``serving_responses.py`` there).
- *translated* (the bundled engine, unified or prefill/decode, a declared OpenAI-compatible
  server, a litellm provider): the gateway turns the request into a chat completion
  (``gateway.responses.to_chat``). A row that becomes a chat field takes its decision from chat's
  table (``chat``: that row's name), so the two tables never disagree; a row without one has its
  own cell.

A cell is chat's ``Decision``: forwarded, accepted and not forwarded (the gateway handles it:
``store``, ``previous_response_id``, ``metadata``; or it asks for nothing the gateway serves), or
refused unless inert (a 400 ``unsupported_parameter`` naming the field, the engine and why). The
docs' table (docs/responses.md) is rendered from ``TABLE`` (``render_markdown``), held by a test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gateway.engines.registry import EngineRecord
from gateway.openai.surface import (
    _CELL,
    PROFILES,
    Decision,
    Profile,
    UnsupportedParameter,
    profile_of,
)
from gateway.openai.surface import RULES as CHAT_RULES
from gateway.responses.schemas import (
    AllowedTools,
    CreateResponseBody,
    FunctionCallItem,
    FunctionCallOutputItem,
    ItemReference,
    MessageItem,
    ReasoningItem,
)

NATIVE = (Profile.SGLANG, Profile.VLLM)  # engines that serve /v1/responses themselves


def _never(value: Any) -> bool:
    return False


def _empty(value: Any) -> bool:
    return not value


def _null(value: Any) -> bool:
    return value is None


@dataclass(frozen=True, slots=True)
class Rule:
    field: str
    native: tuple[Decision, Decision]  # SGLang, vLLM
    chat: str | None = None  # translated engines: the decision of chat's row of this name
    translated: Decision | None = None  # ... or this one, without a chat row
    inert: Callable[[Any], bool] = _never
    inert_text: str = ""
    why: str = ""

    @property
    def feature(self) -> str | None:
        """The capacity feature a translated engine must report where chat's cell is REPORTED."""
        return CHAT_RULES[self.chat].feature if self.chat is not None else None

    def decision(self, profile: Profile) -> tuple[Decision, str]:
        """The cell for ``profile`` and why it refuses (if it does)."""
        if profile in NATIVE:
            return self.native[NATIVE.index(profile)], self.why
        if self.chat is not None:
            chat_rule = CHAT_RULES[self.chat]
            return chat_rule.decision(profile), chat_rule.why or self.why
        assert self.translated is not None, self.field
        return self.translated, self.why


def _row(
    field: str,
    native: str,
    chat: str | None = None,
    translated: str | None = None,
    inert: Callable[[Any], bool] = _never,
    inert_text: str = "",
    why: str = "",
) -> Rule:
    cells = tuple(_CELL[c] for c in native.split())
    assert len(cells) == 2 and (chat is None) != (translated is None), field
    own = _CELL[translated] if translated is not None else None
    return Rule(field, (cells[0], cells[1]), chat, own, inert, inert_text, why)


LOGPROBS = "the gateway does not yet screen logprobs tokens in Responses answers"
INCLUDE = (
    "each value asks for logprobs, encrypted reasoning (opaque: no guard can read it) or the "
    "results of built-in tools, which the gateway does not serve"
)
CONVERSATIONS = "the gateway serves no Conversations API; continue with previous_response_id"
BACKGROUND = "the gateway serves responses while the client waits; it runs none in the background"
TRUNCATION = (
    "the gateway refuses a conversation that does not fit rather than silently dropping its start"
)
PLATFORM = "an OpenAI platform feature that this engine does not have"
CACHE = "a tenant must not steer a prompt cache; the gateway keys engine caches per tenant itself"
SUMMARY = "reasoning summaries need an engine that serves /v1/responses"
ALLOWED_TOOLS = "this engine takes no allowed_tools tool choice"
REFERENCES = "the gateway resolves previous_response_id, not references to single stored items"
FILE_IDS = "file ids name files in OpenAI's storage, which the gateway does not have"
ENCRYPTED = "encrypted reasoning is opaque: no guard can screen it"


def _no_tool_choice(value: Any) -> bool:
    return value in (None, "none", "auto")


def _text_format(value: Any) -> bool:
    return value is None or value.type == "text"


# Cells of SGLang, vLLM; then chat's row for the translated engines, or their own cell.
TABLE: tuple[Rule, ...] = (
    _row("model", "F F", chat="model"),
    _row("input", "F F", chat="messages"),
    _row("instructions", "F F", chat="messages"),
    _row("stream", "F F", chat="stream"),
    _row("stream_options", "D D", translated="D"),
    _row("max_output_tokens", "F F", chat="max_completion_tokens"),
    _row("temperature", "F F", chat="temperature"),
    _row("top_p", "F F", chat="top_p"),
    _row("user", "F F", chat="user"),
    _row("safety_identifier", "F F", chat="safety_identifier"),
    _row("tools", "F F", chat="tools", inert=_empty, inert_text="[]"),
    _row("tool_choice", "F F", chat="tool_choice", inert=_no_tool_choice, inert_text='"auto"'),
    _row("tool_choice: allowed_tools", "F F", translated="R", why=ALLOWED_TOOLS),
    _row("parallel_tool_calls", "F F", chat="parallel_tool_calls"),
    _row("max_tool_calls", "D D", translated="D"),  # counts built-in tool calls only
    _row(
        "text.format",
        "F F",
        chat="response_format",
        inert=_text_format,
        inert_text='{"type": "text"}',
    ),
    _row("text.verbosity", "R R", chat="verbosity", inert=_null, inert_text="null", why=PLATFORM),
    _row("reasoning.effort", "F F", chat="reasoning_effort", inert=_null, inert_text="null"),
    _row("reasoning.summary", "F F", translated="R", inert=_null, inert_text="null", why=SUMMARY),
    _row("reasoning.context", "F F", translated="D"),
    _row("metadata", "D D", translated="D"),  # kept and shown by the gateway, never sent
    _row("store", "D D", translated="D"),  # the gateway stores; engines get store=false
    _row("previous_response_id", "D D", translated="D"),  # resolved by the gateway, per tenant
    _row("top_logprobs", "R R", translated="R", inert=lambda v: v in (None, 0), inert_text="0",
         why=LOGPROBS),
    _row("include", "R R", translated="R", inert=_empty, inert_text="[]", why=INCLUDE),
    _row("conversation", "R R", translated="R", inert=_null, inert_text="null", why=CONVERSATIONS),
    _row("background", "R R", translated="R", inert=lambda v: v in (None, False),
         inert_text="false", why=BACKGROUND),
    _row("truncation", "R R", translated="R", inert=lambda v: v in (None, "disabled"),
         inert_text='"disabled"', why=TRUNCATION),
    _row("service_tier", "R R", chat="service_tier", inert=lambda v: v in (None, "auto", "default"),
         inert_text='"auto", "default"', why=PLATFORM),
    _row("prompt", "R R", translated="R", inert=_null, inert_text="null", why=PLATFORM),
    _row("prompt_cache_key", "R R", chat="prompt_cache_key", inert=_null, inert_text="null",
         why=CACHE),
    _row("prompt_cache_retention", "R R", chat="prompt_cache_retention", inert=_null,
         inert_text="null", why=CACHE),
    _row("prompt_cache_options", "R R", chat="prompt_cache_options", inert=_null,
         inert_text="null", why=CACHE),
    _row("moderation", "R R", chat="moderation", inert=_null, inert_text="null", why=PLATFORM),
    _row("context_management", "R R", translated="R", inert=_null, inert_text="null",
         why=PLATFORM),
    _row("input: developer or system role", "F F", chat="messages: developer role"),
    _row("input: function_call items", "F F", chat="messages: assistant tool_calls"),
    _row("input: function_call_output items", "F F", chat="messages: tool role"),
    _row("input: reasoning items", "F F", translated="D"),
    _row("input: encrypted reasoning", "R R", translated="R", why=ENCRYPTED),
    _row("input: input_image parts", "F F", chat="messages: image_url parts"),
    _row("input: input_file parts", "R R", chat="messages: file parts"),
    _row("input: refusal parts", "F F", chat="messages: refusal parts"),
    _row("input: file_id references", "R R", translated="R", why=FILE_IDS),
    _row("input: item_reference items", "R R", translated="R", why=REFERENCES),
)  # fmt: skip
RULES = {rule.field: rule for rule in TABLE}


def requested(body: CreateResponseBody) -> dict[str, Any]:
    """Every row of the table this request uses, with its value (True for input features)."""
    fields: dict[str, Any] = {
        name: getattr(body, name) for name in body.model_fields_set if name in RULES
    }
    if body.text is not None:
        fields.pop("text", None)
        if body.text.format is not None:
            fields["text.format"] = body.text.format
        if body.text.verbosity is not None:
            fields["text.verbosity"] = body.text.verbosity
    if body.reasoning is not None:
        reasoning = body.reasoning
        fields["reasoning.effort"] = reasoning.effort
        if reasoning.summary is not None or reasoning.generate_summary is not None:
            fields["reasoning.summary"] = reasoning.summary or reasoning.generate_summary
        if reasoning.context is not None or reasoning.mode is not None:
            fields["reasoning.context"] = True
    if isinstance(body.tool_choice, AllowedTools):
        fields["tool_choice: allowed_tools"] = True
    if not isinstance(body.input, str):
        for item in body.input:
            fields.update(dict.fromkeys(_features(item), True))
    return fields


def _features(item: Any) -> list[str]:
    if isinstance(item, MessageItem):
        found = [f"input: {p.type} parts" for p in item.parts() if p.type in _PART_ROWS]
        if item.role in ("developer", "system"):
            found.append("input: developer or system role")
        if any(p.type in ("input_image", "input_file") and p.file_id for p in item.parts()):
            found.append("input: file_id references")
        return found
    if isinstance(item, FunctionCallItem):
        return ["input: function_call items"]
    if isinstance(item, FunctionCallOutputItem):
        parts = item.output if isinstance(item.output, list) else []
        return ["input: function_call_output items"] + [
            f"input: {p.type} parts" for p in parts if p.type in _PART_ROWS
        ]
    if isinstance(item, ReasoningItem):
        encrypted = ["input: encrypted reasoning"] if item.encrypted_content else []
        return ["input: reasoning items", *encrypted]
    assert isinstance(item, ItemReference)
    return ["input: item_reference items"]


_PART_ROWS = frozenset({"input_image", "input_file", "refusal"})


def refusal_for(
    fields: dict[str, Any], profile: Profile, features: frozenset[str] = frozenset()
) -> UnsupportedParameter | None:
    """Why this engine cannot take this request, or None when it can; ``features``: what the
    engine reports serving (chat's REPORTED cells need theirs)."""
    for name, value in fields.items():
        rule = RULES[name]
        decision, why = rule.decision(profile)
        missing = decision is Decision.REPORTED and rule.feature not in features
        if (decision is Decision.REFUSE or missing) and not rule.inert(value):
            param = name.split(":")[0].split(" ")[0]
            message = f"'{name}' is not supported by this model's engine ({profile.value}): {why}."
            if missing:
                message += f" (It does not report '{rule.feature}' in its capacity.)"
            if rule.inert_text:
                message += f" Accepted values there: {rule.inert_text}."
            return UnsupportedParameter(message, param=param)
    return None


def refusal(fields: dict[str, Any], record: EngineRecord) -> UnsupportedParameter | None:
    features = record.snapshot.features if record.snapshot is not None else frozenset()
    return refusal_for(fields, profile_of(record), features)


def native(record: EngineRecord) -> bool:
    """Whether the engine serves /v1/responses itself (the request is passed on)."""
    return profile_of(record) in NATIVE


def forwarded(field: str, profile: Profile) -> bool:
    return RULES[field].decision(profile)[0] is Decision.FORWARD


def render_markdown() -> str:
    """The table as the docs show it."""
    head = "| field | " + " | ".join(p.value for p in PROFILES) + " |"
    lines = [head, "|" + "---|" * (len(PROFILES) + 1)]
    for rule in TABLE:
        cells = []
        for profile in PROFILES:
            decision, _ = rule.decision(profile)
            cell = decision.value
            if decision is Decision.REFUSE and rule.inert_text:
                cell = f"refused unless {rule.inert_text}"
            if decision is Decision.REPORTED:
                cell = f"forwarded where the engine reports `{rule.feature}`"
            cells.append(cell)
        lines.append(f"| `{rule.field}` | " + " | ".join(cells) + " |")
    reasons = sorted(
        {
            why
            for rule in TABLE
            for profile in PROFILES
            for decision, why in [rule.decision(profile)]
            if decision in (Decision.REFUSE, Decision.REPORTED) and why
        }
    )
    lines += ["", "Why a field is refused (the 400 says which applies):", ""]
    lines += [f"- {why}." for why in reasons]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m gateway.responses.surface: the docs' table
    print(render_markdown(), end="")
