"""A chat request's answer shape (``backend.server.structured``): the plan read from the request,
and the shaper that turns released text into content and tool calls, streamed or whole.

Text is fed a few characters at a time, as a stream releases it; the deltas joined must be the
whole answer, and a choice ends as the module docstring says (``length`` keeps the partial text as
content; ``stop`` under a grammar with text that is not JSON fails the choice)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from backend.core.errors import InvalidRequest
from backend.core.grammar import GrammarViolation
from backend.model.tool_calls import HERMES, LLAMA3_JSON
from backend.server.openai_schema import ChatCompletionRequest
from backend.server.structured import Mode, Shaper, plan

PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris"]}}, "required": ["city"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "get_time"}},
]


def _body(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


def _feed(shaper: Shaper, text: str, reason: str, step: int = 3) -> tuple[str, list, str]:
    content, deltas = "", []
    for i in range(0, len(text), step):
        out = shaper.push(text[i : i + step])
        content, deltas = content + out.content, deltas + out.calls
    out, finish = shaper.finish(reason)
    return content + out.content, deltas + out.calls, finish


def _assembled(deltas: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Calls as a client assembles OpenAI's stream: header first, then argument pieces."""
    calls: list[dict[str, str]] = []
    for delta in deltas:
        if "id" in delta:
            assert delta["index"] == len(calls) and delta["type"] == "function"
            assert delta["function"]["arguments"] == ""
            calls.append({"name": delta["function"]["name"], "arguments": ""})
        else:
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return calls


def test_the_plan_of_each_request_shape() -> None:
    assert plan(_body(), HERMES).mode is Mode.TEXT
    assert plan(_body(tools=TOOLS, tool_choice="none"), HERMES).grammar is None
    assert plan(_body(tools=TOOLS), HERMES).mode is Mode.AUTO
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": PARAMS, "strict": True}}
    schema = plan(_body(response_format=fmt), HERMES)
    assert schema.mode is Mode.JSON and schema.grammar is not None
    closed = {**PARAMS, "additionalProperties": False}  # strict: no member the schema lacks
    assert json.loads(schema.grammar.schema or "") == closed and schema.grammar.strict
    named = plan(
        _body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        HERMES,
    )
    assert named.mode is Mode.NAMED and json.loads(named.grammar.schema or "") == closed
    required = plan(_body(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), HERMES)
    calls = json.loads(required.grammar.schema or "")
    assert calls["maxItems"] == 1 and calls["minItems"] == 1
    names = [item["properties"]["name"]["const"] for item in calls["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    # name before arguments: the calls stream their names first
    assert list(calls["items"]["anyOf"][0]["properties"]) == ["name", "arguments"]
    with pytest.raises(InvalidRequest):
        plan(_body(tools=TOOLS, response_format={"type": "json_object"}), HERMES)


def test_a_named_call_streams_its_arguments_and_ends_stop() -> None:
    named = plan(
        _body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
        HERMES,
    )
    shaper = Shaper(named, "r1")
    text = '{"city": "Paris"}'
    content, deltas, finish = _feed(shaper, text, "stop")
    assert (content, finish) == ("", "stop")
    assert _assembled(deltas) == [{"name": "get_weather", "arguments": text}]
    assert len(deltas) > 2  # argument deltas as they came, not one piece
    message, calls = shaper.result(finish)
    assert message is None and calls is not None and calls[0]["function"]["arguments"] == text


def test_required_calls_stream_each_as_it_completes() -> None:
    required = plan(_body(tools=TOOLS, tool_choice="required"), HERMES)
    shaper = Shaper(required, "r1")
    text = (
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {}}]'
    )
    first = shaper.push(text[:60])
    assert [d["function"].get("name") for d in first.calls if "id" in d] == ["get_weather"]
    content, deltas, finish = _feed(shaper, text[60:], "stop")
    assert (content, finish) == ("", "tool_calls")
    assert _assembled(first.calls + deltas) == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"name": "get_time", "arguments": "{}"},
    ]


@pytest.mark.parametrize("mode", ["required", "named"])
def test_a_call_cut_by_the_budget_ends_length_with_its_text(mode: str) -> None:
    choice: Any = (
        "required" if mode == "required" else {"type": "function", "function": {"name": "get_time"}}
    )
    shaper = Shaper(plan(_body(tools=TOOLS, tool_choice=choice), HERMES), "r1")
    text = '[{"name": "get_weather", "argu' if mode == "required" else '{"zone": "ut'
    _, _, finish = _feed(shaper, text, "length")
    assert finish == "length"
    assert shaper.result(finish) == (text, None)  # the partial JSON, as text; no call


def test_auto_reads_calls_in_the_family_format_and_keeps_other_text() -> None:
    auto = plan(_body(tools=TOOLS), HERMES)
    shaper = Shaper(auto, "r1")
    text = 'Checking.<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}</tool_call>'
    content, deltas, finish = _feed(shaper, text, "stop")
    assert content == "Checking." and finish == "tool_calls"
    assert _assembled(deltas) == [{"name": "get_time", "arguments": '{"zone": "utc"}'}]
    plain = Shaper(auto, "r2")
    text = "No <tool_call> here, just <tool_call>{broken"
    content, deltas, finish = _feed(plain, text, "stop")
    assert (content, deltas, finish) == (text, [], "stop")  # never dropped
    assert plain.result(finish) == (text, None)
    llama = Shaper(plan(_body(tools=TOOLS), LLAMA3_JSON), "r3")
    content, deltas, finish = _feed(llama, '{"name": "get_time", "parameters": {}}', "stop")
    assert content == "" and finish == "tool_calls" and _assembled(deltas)[0]["name"] == "get_time"


def test_stop_with_text_that_is_not_json_fails_the_choice() -> None:
    shaper = Shaper(plan(_body(response_format={"type": "json_object"}), HERMES), "r1")
    shaper.push('{"a": ')
    with pytest.raises(GrammarViolation):
        shaper.finish("stop")
    ok = Shaper(plan(_body(response_format={"type": "json_object"}), HERMES), "r2")
    assert _feed(ok, '{"a": 1}', "stop")[::2] == ('{"a": 1}', "stop")
