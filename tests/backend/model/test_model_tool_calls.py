"""Tool calls read out of a model's text, per family format (``backend.model.tool_calls``).

Each format reads its calls (several in one answer: parallel calls), keeps the text before them as
content, and gives back, as content, whole, any answer that does not read completely as calls;
``detect`` picks the format a chat template writes; ``may_start_call`` holds back exactly the text
that may still become a call."""

from __future__ import annotations

import json

import pytest
from tiny_families import LLAMA3_TEMPLATE, MISTRAL_TOOL_TEMPLATE, QWEN2_TEMPLATE

from backend.model.tool_calls import HERMES, LLAMA3_JSON, MISTRAL, ParsedCall, detect

WEATHER = ParsedCall("get_weather", json.dumps({"city": "Paris"}))
TIME = ParsedCall("get_time", json.dumps({"zone": "utc"}))


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [
        (
            HERMES,
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}'
            "</tool_call>",
            "Let me look.",
            (WEATHER, TIME),
        ),
        (
            LLAMA3_JSON,
            '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            '{"name": "get_time", "parameters": {"zone": "utc"}}',
            None,
            (WEATHER, TIME),
        ),
        (
            LLAMA3_JSON,
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
            None,
            (WEATHER,),
        ),
        (
            MISTRAL,
            'ok [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {"zone": "utc"}}]',
            "ok",
            (WEATHER, TIME),
        ),
    ],
    ids=["hermes", "llama3", "llama3-python-tag", "mistral"],
)
def test_calls_are_read_with_the_text_before_them(fmt, text, content, calls) -> None:
    parsed = fmt.parse(text)
    assert parsed.calls == calls
    assert parsed.content == content


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        (HERMES, "just text"),
        (HERMES, '<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>'),  # bad JSON
        (HERMES, '<tool_call>{"name": "f", "arguments": {}}'),  # never closed
        (HERMES, '<tool_call>{"name": "f", "arguments": {}}</tool_call> and more'),
        (HERMES, '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        (HERMES, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),  # not an object
        (LLAMA3_JSON, 'I would call {"name": "f", "parameters": {}}'),  # not only calls
        (LLAMA3_JSON, '{"name": "f", "parameters": {}} trailing'),
        (MISTRAL, "[TOOL_CALLS] [{"),
        (MISTRAL, "[TOOL_CALLS] []"),
    ],
)
def test_text_that_is_not_only_calls_is_content_whole(fmt, text) -> None:
    parsed = fmt.parse(text)
    assert parsed.calls == () and parsed.content == text


def test_the_format_is_read_from_the_template() -> None:
    assert detect(QWEN2_TEMPLATE) is HERMES
    assert detect(MISTRAL_TOOL_TEMPLATE) is MISTRAL
    assert detect(LLAMA3_TEMPLATE) is LLAMA3_JSON
    assert detect("{{ messages }}") is HERMES  # no sign of a format: the widest-used


@pytest.mark.parametrize(
    ("fmt", "text", "held"),
    [
        (HERMES, "hello <tool", "<tool"),
        (HERMES, "hello <tool_call>{", "<tool_call>{"),
        (HERMES, "hello <b>", ""),
        (MISTRAL, "sure [TOOL", "[TOOL"),
        (LLAMA3_JSON, '  {"name"', '{"name"'),
        (LLAMA3_JSON, "<|pyth", "<|pyth"),
        (LLAMA3_JSON, "The answer", ""),
    ],
)
def test_only_what_may_become_a_call_is_held_back(fmt, text, held) -> None:
    assert text[fmt.may_start_call(text) :].strip() == held
