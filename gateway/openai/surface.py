"""Which OpenAI request fields each engine kind serves: the one place the gateway decides.

``TABLE`` has a row per request field of OpenAI's published schemas (and per message feature:
roles, content-part types, tool calls) and a column per engine kind (``Profile``: the bundled
engine, unified or as a prefill/decode pair, SGLang, vLLM, a declared OpenAI-compatible server,
a litellm provider). A cell is

- ``forwarded``: sent to the engine as the client wrote it;
- ``accepted, not forwarded``: no effect on the answer there (``metadata`` is only ever about
  stored completions, which the gateway never asks an engine for);
- ``refused``: a 400 ``unsupported_parameter`` at the door naming the field and the engine,
  before admission takes anything from the tenant's limits;
- ``forwarded where the engine reports it``: forwarded to an engine whose own introspection names
  the feature (``CapacityReport.features``, ``contracts.engine``: the bundled engine reports
  ``tools`` and ``structured_output`` when it serves them), refused like the above by one that
  does not. The capability is the engine's word, read with its capacity, never a table here.

A value that asks for nothing (``Rule.inert``: a penalty of 0, ``tools: []``, ``n: 1``,
``response_format: {"type": "text"}``...) is accepted by every engine: it is left out of what an
engine that does not take the field receives, so no engine ever refuses what the door let in.
Admission (``gateway.proxy.admission``) routes a request only to engines that take all of it and
refuses it when none does; ``for_engine`` shapes the body for the chosen one. The table in
``gateway/README.md`` is rendered from ``TABLE`` (``render_markdown``) and held to it by a test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from contracts.engine import STRUCTURED_OUTPUT
from contracts.engine import TOOLS as TOOLS_FEATURE
from gateway.engines.registry import EngineRecord
from gateway.engines.spec import EngineKind
from gateway.errors import InvalidRequest
from gateway.openai.schemas import ChatCompletionBody, CompletionBody


class Profile(StrEnum):
    """An engine kind as the table tells them apart."""

    BUNDLED = "bundled"
    BUNDLED_PD = "bundled prefill/decode"
    SGLANG = "sglang"
    VLLM = "vllm"
    OPENAI = "openai"
    LITELLM = "litellm"


PROFILES = tuple(Profile)
_BY_KIND = {
    EngineKind.SGLANG: Profile.SGLANG,
    EngineKind.VLLM: Profile.VLLM,
    EngineKind.OPENAI: Profile.OPENAI,
    EngineKind.LITELLM: Profile.LITELLM,
}


class Decision(StrEnum):
    FORWARD = "forwarded"
    DROP = "accepted, not forwarded"
    REFUSE = "refused"
    REPORTED = "forwarded where the engine reports it"


_CELL = {"F": Decision.FORWARD, "D": Decision.DROP, "R": Decision.REFUSE, "E": Decision.REPORTED}


def _never(value: Any) -> bool:
    return False


@dataclass(frozen=True, slots=True)
class Rule:
    field: str
    cells: tuple[Decision, ...]  # one per PROFILES entry
    inert: Callable[[Any], bool] = _never
    inert_text: str = ""  # the inert values, as the README shows them
    why: str = ""  # why engines refuse it (the error says so)
    feature: str | None = None  # REPORTED cells: the capacity feature the engine must report

    def decision(self, profile: Profile) -> Decision:
        return self.cells[PROFILES.index(profile)]

    def takes(self, record: EngineRecord) -> bool:
        """Whether this engine is sent the field (as the client wrote it)."""
        decision = self.decision(profile_of(record))
        if decision is Decision.REPORTED:
            snapshot = record.snapshot
            return snapshot is not None and self.feature in snapshot.features
        return decision is Decision.FORWARD


def _row(
    field: str,
    cells: str,
    inert: Callable[[Any], bool] = _never,
    inert_text: str = "",
    why: str = "",
    feature: str | None = None,
) -> Rule:
    decisions = tuple(_CELL[c] for c in cells.split())
    assert len(decisions) == len(PROFILES), field
    assert (Decision.REPORTED in decisions) == (feature is not None), field
    return Rule(field, decisions, inert, inert_text, why, feature)


def _null(value: Any) -> bool:
    return value is None


def _zero(value: Any) -> bool:
    return value is None or value == 0


def _empty(value: Any) -> bool:
    return not value


def _false(value: Any) -> bool:
    return value is None or value is False


TOOLS = "this engine does not serve tool calls"
PLATFORM = "an OpenAI platform feature that this engine does not have"
AUDIO = "the gateway screens text only; audio cannot be checked for other tenants' data"
CACHE = "a tenant must not steer a prompt cache; the gateway keys engine caches per tenant itself"
STORE = (
    "the gateway never stores completions; a provider's stored completions would be visible "
    "across the tenants of the operator's account"
)
ONE_PROMPT = "the gateway counts, limits and screens one prompt per request"
MODEL_INPUT = "this engine does not read this kind of input"
DEPRECATED = "OpenAI's deprecated function calling; this engine serves tools, if any"

# Columns:          bundled  bundled-pd  sglang  vllm  openai  litellm
TABLE: tuple[Rule, ...] = (
    _row("model", "F F F F F F"),
    _row("messages", "F F F F F F"),
    _row("prompt", "F F F F F F"),
    _row("prompt (an array)", "R R R R R R", why=ONE_PROMPT),
    _row("stream", "F F F F F F"),
    _row("stream_options", "F F F F F F"),
    _row("max_tokens", "F F F F F F"),
    _row("max_completion_tokens", "F F F F F F"),
    _row("temperature", "F F F F F F"),
    _row("top_p", "F F F F F F"),
    _row("seed", "F F F F F F"),
    _row("stop", "F F F F F F"),
    _row("n", "F F F F F F"),
    _row("user", "F F F F F F"),
    _row("presence_penalty", "F F F F F F"),
    _row("frequency_penalty", "F F F F F F"),
    _row("logit_bias", "F F F F F F"),
    _row("logprobs", "F F F F F F"),
    _row("top_logprobs", "F F F F F F"),
    _row("tools", "E E F F F F", _empty, "[]", TOOLS, TOOLS_FEATURE),
    _row(
        "tool_choice",
        "E E F F F F",
        lambda v: v in (None, "none"),
        '"none"',
        TOOLS,
        TOOLS_FEATURE,
    ),
    _row("parallel_tool_calls", "F F F F F F"),
    _row("functions", "R R R R F F", _empty, "[]", DEPRECATED),
    _row("function_call", "R R R R F F", lambda v: v in (None, "none"), '"none"', DEPRECATED),
    _row(
        "response_format",
        "E E F F F F",
        lambda v: v is None or v.get("type") == "text",
        '{"type": "text"}',
        "this engine does not serve structured output",
        STRUCTURED_OUTPUT,
    ),
    _row("metadata", "D D D D D D"),
    _row("cache_salt", "D D D D D D"),  # vLLM/SGLang's; the gateway sets its own per tenant
    _row("store", "R R R R R R", _false, "false", STORE),
    _row(
        "service_tier",
        "R R R R F F",
        lambda v: v in (None, "auto", "default"),
        '"auto", "default"',
        PLATFORM,
    ),
    _row("modalities", "R R R R R R", lambda v: v in (None, ["text"]), '["text"]', AUDIO),
    _row("audio", "R R R R R R", _null, "null", AUDIO),
    _row("prediction", "R R R R F F", _null, "null", PLATFORM),
    _row("web_search_options", "R R R R F F", _null, "null", PLATFORM),
    _row("reasoning_effort", "R R F F F F", _null, "null", "this engine does not reason"),
    _row("verbosity", "R R R R F F", _null, "null", PLATFORM),
    _row("safety_identifier", "D D D D F F"),
    _row("prompt_cache_key", "R R R R R R", _null, "null", CACHE),
    _row("prompt_cache_options", "R R R R R R", _null, "null", CACHE),
    _row("prompt_cache_retention", "R R R R R R", _null, "null", CACHE),
    _row("moderation", "R R R R F F", _null, "null", PLATFORM),
    _row("echo", "R R F F F F", _false, "false", "this engine does not echo prompts"),
    _row("suffix", "R R R R F F", _empty, '""', "this engine does not insert text"),
    _row("best_of", "R R R R F F", lambda v: v in (None, 1), "1", "this engine samples n only"),
    _row("messages: developer role", "F F F F F F"),
    _row("messages: tool role", "E E F F F F", why=TOOLS, feature=TOOLS_FEATURE),
    _row("messages: function role", "R R F F F F", why=DEPRECATED),
    _row("messages: assistant tool_calls", "E E F F F F", why=TOOLS, feature=TOOLS_FEATURE),
    _row("messages: assistant function_call", "R R F F F F", why=DEPRECATED),
    _row("messages: text content parts", "F F F F F F"),
    _row("messages: image_url parts", "R R F F F F", why=MODEL_INPUT),
    _row("messages: input_audio parts", "R R R F F F", why=MODEL_INPUT),
    _row("messages: file parts", "R R R R F F", why=MODEL_INPUT),
    _row("messages: refusal parts", "R R R R F F", why=MODEL_INPUT),
    _row("messages: assistant audio", "R R R R R R", why=AUDIO),
)
RULES = {rule.field: rule for rule in TABLE}
_MESSAGE_FIELDS = {"messages", "prompt"}


def profile_of(record: EngineRecord) -> Profile:
    if record.spec.kind is not EngineKind.BUNDLED:
        return _BY_KIND[record.spec.kind]
    snapshot = record.snapshot
    roles = {role.role for role in snapshot.roles} if snapshot is not None else set()
    return Profile.BUNDLED_PD if "prefill" in roles else Profile.BUNDLED


Body = ChatCompletionBody | CompletionBody


def requested(body: Body) -> dict[str, Any]:
    """Every row of the table this request uses, with its value (True for message features)."""
    fields: dict[str, Any] = {
        name: getattr(body, name) for name in body.model_fields_set if name in RULES
    }
    if isinstance(body, CompletionBody):
        if not isinstance(body.prompt, str):
            fields["prompt (an array)"] = True
        return fields
    for message in body.messages:
        features = [f"messages: {part} parts" for part in message.part_types() - {"text"}]
        if message.role == "developer":
            features.append("messages: developer role")
        if message.role in ("tool", "function"):
            features.append(f"messages: {message.role} role")
        if message.tool_calls:
            features.append("messages: assistant tool_calls")
        if message.function_call:
            features.append("messages: assistant function_call")
        if "text" in message.part_types():
            features.append("messages: text content parts")
        if message.audio is not None:
            features.append("messages: assistant audio")
        fields.update(dict.fromkeys(features, True))
    return fields


class UnsupportedParameter(InvalidRequest):
    code = "unsupported_parameter"


def refusal(fields: dict[str, Any], record: EngineRecord) -> UnsupportedParameter | None:
    """Why this engine cannot take this request, or None when it can."""
    profile = profile_of(record)
    for name, value in fields.items():
        rule = RULES[name]
        decision = rule.decision(profile)
        refused = decision is Decision.REFUSE or (
            decision is Decision.REPORTED and not rule.takes(record)
        )
        if refused and not rule.inert(value):
            param = name.split(":")[0].split(" ")[0]
            message = (
                f"'{name}' is not supported by this model's engine ({profile.value}): {rule.why}."
            )
            if decision is Decision.REPORTED:
                message += f" (It does not report '{rule.feature}' in its capacity.)"
            if rule.inert_text:
                message += f" Accepted values there: {rule.inert_text}."
            return UnsupportedParameter(message, param=param)
    return None


def serving(
    records: Iterable[EngineRecord], fields: dict[str, Any]
) -> tuple[list[EngineRecord], UnsupportedParameter | None]:
    """The engines that take every field of the request, and the first refusal (if any)."""
    taking: list[EngineRecord] = []
    first: UnsupportedParameter | None = None
    for record in records:
        refused = refusal(fields, record)
        if refused is None:
            taking.append(record)
        elif first is None:
            first = refused
    return taking, first


def for_engine(body: dict[str, Any], record: EngineRecord) -> dict[str, Any]:
    """The upstream body for this engine: fields it does not take (inert, or not forwarded)
    left out."""
    dropped = [
        name
        for name in body
        if name in RULES and name not in _MESSAGE_FIELDS and not RULES[name].takes(record)
    ]
    if not dropped:
        return body
    return {name: value for name, value in body.items() if name not in dropped}


def render_markdown() -> str:
    """The table as the README shows it."""
    head = "| field | " + " | ".join(p.value for p in PROFILES) + " |"
    lines = [head, "|" + "---|" * (len(PROFILES) + 1)]
    for rule in TABLE:
        cells = []
        for profile in PROFILES:
            decision = rule.decision(profile)
            cell = decision.value
            if decision is Decision.REFUSE and rule.inert_text:
                cell = f"refused unless {rule.inert_text}"
            if decision is Decision.REPORTED:
                cell = f"forwarded where the engine reports `{rule.feature}`"
            cells.append(cell)
        lines.append(f"| `{rule.field}` | " + " | ".join(cells) + " |")
    reasons = sorted({rule.why for rule in TABLE if rule.why})
    lines += ["", "Why a field is refused (the 400 says which applies):", ""]
    lines += [f"- {why}." for why in reasons]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m gateway.openai.surface: the README's table
    print(render_markdown(), end="")
