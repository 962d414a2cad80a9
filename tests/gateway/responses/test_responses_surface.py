"""The Responses surface (``gateway.responses.surface``) and what each kind of engine receives:
one row per published field (and per input feature), the translated engines' cells taken from
chat's table, refusals naming field, engine and reason; a request a translated engine accepts
becomes a chat request chat's own table accepts (``to_chat``), and a native engine never receives
the client's ``previous_response_id``, ``conversation`` or ``store`` (``passthrough``). The docs'
table is the rendered one."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from openai_contract import request_fields

from gateway.openai import surface as chat_surface
from gateway.openai.surface import PROFILES, Decision, Profile
from gateway.responses import surface
from gateway.responses.passthrough import NEVER_SENT, native_body
from gateway.responses.schemas import CreateResponseBody
from gateway.responses.to_chat import chat_body

DOCS = Path(__file__).parents[3] / "docs" / "responses.md"
TRANSLATED = [p for p in PROFILES if p not in surface.NATIVE]
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
SAMPLES: list[dict[str, Any]] = [
    {"input": "hi"},
    {"input": "hi", "instructions": "short", "temperature": 0.3, "max_output_tokens": 32},
    {"input": "hi", "tools": [TOOL], "tool_choice": "required"},
    {"input": "hi", "tools": [], "tool_choice": "auto"},
    {"input": "hi", "text": {"format": {"type": "json_object"}}},
    {"input": "hi", "text": {"format": {"type": "text"}}},
    {"input": "hi", "reasoning": {"effort": "low"}},
    {"input": "hi", "reasoning": {"summary": "auto"}},
    {"input": "hi", "store": False, "metadata": {"a": "b"}, "include": []},
    {"input": "hi", "service_tier": "flex"},
    {"input": [{"role": "developer", "content": "rules"}, {"role": "user", "content": "q"}]},
    {
        "input": [
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "1"},
        ],
        "tools": [TOOL],
    },
    {
        "input": [
            {"type": "reasoning", "summary": [], "content": []},
            {"role": "user", "content": "q"},
        ]
    },
    {
        "input": [
            {
                "role": "user",
                "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}],
            }
        ]
    },
    {"input": [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}]},
]


def _body(data: dict[str, Any]) -> CreateResponseBody:
    return CreateResponseBody.model_validate({"model": "m", **data})


def test_every_published_field_has_a_row() -> None:
    top = {field.split(".")[0] for field in surface.RULES if not field.startswith("input:")}
    assert request_fields("CreateResponse") - {"text", "reasoning"} <= top
    assert {"text.format", "text.verbosity", "reasoning.effort", "reasoning.summary"} <= set(
        surface.RULES
    )


def test_translated_cells_are_chats() -> None:
    for rule in surface.TABLE:
        if rule.chat is None:
            continue
        for profile in TRANSLATED:
            assert rule.decision(profile)[0] is chat_surface.RULES[rule.chat].decision(profile)


def test_a_refusal_names_the_field_the_engine_and_why() -> None:
    fields = surface.requested(_body({"input": "hi", "tools": [TOOL]}))
    refused = surface.refusal_for(fields, Profile.BUNDLED)
    assert refused is not None and refused.status == 400 and refused.code == "unsupported_parameter"
    assert refused.param == "tools"
    assert refused.message == (
        "'tools' is not supported by this model's engine (bundled): this engine does not "
        "serve tool calls. (It does not report 'tools' in its capacity.) Accepted values there: []."
    )
    # a bundled engine that reports tools in its capacity takes them, as chat does
    assert surface.refusal_for(fields, Profile.BUNDLED, frozenset({"tools"})) is None
    assert surface.refusal_for(fields, Profile.VLLM) is None
    everywhere = surface.requested(_body({"input": "hi", "conversation": "conv_1"}))
    for profile in PROFILES:
        refused = surface.refusal_for(everywhere, profile)
        assert refused is not None and refused.param == "conversation"
        assert "Conversations API" in refused.message


def test_inert_values_pass_everywhere() -> None:
    inert = _body(
        {"input": "hi", "tools": [], "include": [], "truncation": "disabled", "background": False,
         "top_logprobs": 0, "text": {"format": {"type": "text"}}, "service_tier": "auto"}
    )  # fmt: skip
    for profile in PROFILES:
        assert surface.refusal_for(surface.requested(inert), profile) is None


def _chat_refusal(chat: Any, profile: Profile) -> str | None:
    """Chat's own decision (``gateway.openai.surface.refusal``, by profile)."""
    for name, value in chat_surface.requested(chat).items():
        rule = chat_surface.RULES[name]
        if rule.decision(profile) is Decision.REFUSE and not rule.inert(value):
            return name
    return None


@pytest.mark.parametrize("data", SAMPLES)
def test_what_a_translated_engine_accepts_chat_accepts_too(data) -> None:
    body = _body(data)
    fields = surface.requested(body)
    for profile in TRANSLATED:
        if surface.refusal_for(fields, profile) is None:
            assert _chat_refusal(chat_body(body), profile) is None, (profile, data)


@pytest.mark.parametrize("data", SAMPLES)
def test_a_native_engine_gets_only_forwarded_fields_and_never_the_engine_state(data) -> None:
    body = _body({**data, "store": True, "previous_response_id": "resp_x", "metadata": {"k": "v"}})
    for profile in surface.NATIVE:
        sent = native_body(body, history=[], max_output_tokens=50, profile=profile)
        assert sent["store"] is False and sent["max_output_tokens"] == 50
        assert not set(NEVER_SENT) - {"store"} & set(sent)
        assert "metadata" not in sent
        for name in sent:
            if name not in ("store", "max_output_tokens", "text", "reasoning"):
                assert surface.forwarded(name, profile), name


def test_the_docs_table_is_the_rendered_one() -> None:
    found = re.search(
        r"<!-- responses-surface:start -->\n(.*)<!-- responses-surface:end -->",
        DOCS.read_text(encoding="utf-8"),
        re.S,
    )
    assert found is not None
    assert found.group(1) == surface.render_markdown(), "run: python -m gateway.responses.surface"
