"""The body of POST /v1/responses (``gateway.responses.schemas``): every field of OpenAI's
published ``CreateResponse`` is known; what a client gets wrong is a 400 whose message and param
name the field, as the HTTP edge renders it (``contracts.http_edge.validation_message``)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.exceptions import RequestValidationError
from openai_contract import request_fields
from pydantic import ValidationError

from contracts.http_edge import validation_message
from gateway.responses.schemas import (
    CreateResponseBody,
    FunctionCallItem,
    FunctionCallOutputItem,
    ItemReference,
    MessageItem,
    ReasoningItem,
)


def refusal(data: dict[str, Any]) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as caught:
        CreateResponseBody.model_validate({"model": "m", **data})
    return validation_message(RequestValidationError(caught.value.errors()))


def test_every_published_field_is_known() -> None:
    assert request_fields("CreateResponse") <= set(CreateResponseBody.model_fields)
    assert set(CreateResponseBody.model_fields) <= request_fields("CreateResponse")


ITEMS = [
    {"role": "user", "content": "plain"},
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "d"}]},
    {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": "a", "annotations": [], "logprobs": []}],
    },
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1"},
    {"type": "function_call_output", "call_id": "c1", "output": "42"},
    {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "t"}],
    },
    {"id": "msg_9"},
    {
        "role": "user",
        "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}],
    },
]
FORMAT = {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}


def test_the_input_shapes_clients_send() -> None:
    body = CreateResponseBody.model_validate(
        {
            "model": "m",
            "input": ITEMS,
            "instructions": "be brief",
            "tools": [{"type": "function", "name": "f", "parameters": {}, "strict": True}],
            "tool_choice": {"type": "function", "name": "f"},
            "text": {"format": FORMAT},
            "reasoning": {"effort": "low", "summary": None},
            "max_output_tokens": 64,
            "store": False,
            "metadata": {"k": "v"},
            "stream": True,
            "stream_options": {"include_obfuscation": False},
            "truncation": "disabled",
            "previous_response_id": None,
            "user": "u",
            "safety_identifier": "s",
        }
    )
    kinds = [type(item) for item in body.items()]
    assert kinds == [
        MessageItem, MessageItem, MessageItem, FunctionCallItem, FunctionCallOutputItem,
        ReasoningItem, ItemReference, MessageItem,
    ]  # fmt: skip
    assert "previous_response_id" not in body.model_fields_set  # a null is not a value set
    assert body.stores is False
    assert CreateResponseBody.model_validate({"model": "m", "input": "x"}).stores is True


@pytest.mark.parametrize(
    ("data", "message", "param"),
    [
        ({"input": "x", "temperture": 1}, "unknown field 'temperture'", "temperture"),
        ({"input": "x", "tools": [{"type": "web_search"}]},
         "tools: Value error, tool 0: the gateway serves function tools only, not 'web_search'",
         "tools"),
        ({"input": [{"type": "computer_call", "id": "x"}]},
         "input: Value error, item 0: input item type 'computer_call' is not supported", "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]},
         "input: Value error, item 0: content part 0: text: Input should be a valid string",
         "input"),
        ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "a"}]}]},
         "input: Value error, item 0: content part 0: a user message has no output_text parts",
         "input"),
        ({"input": [{"role": "user", "content": "x", "extra": 1}]},
         "input: Value error, item 0: unknown field 'extra'", "input"),
        ({"input": "x", "max_output_tokens": 8},
         "max_output_tokens: Input should be greater than or equal to 16", "max_output_tokens"),
        ({"input": "x", "tool_choice": "required"},
         "body: Value error, tool_choice 'required' or a named function needs tools", None),
        ({"input": "x", "tool_choice": {"type": "web_search_preview"}},
         "tool_choice: Value error, must be 'none', 'auto', 'required', a function", "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}},
         "text.format: Value error, a json_schema format needs 'name' and 'schema'", "text.format"),
        ({"input": "x", "previous_response_id": "r", "conversation": "c"},
         "body: Value error, give previous_response_id or conversation, not both", None),
        ({"input": "x", "stream_options": {}},
         "body: Value error, stream_options is only allowed with stream=true", None),
        ({"input": "\ud800"}, "input: Value error, text is not valid Unicode", "input"),
        ({"input": []}, "input: Value error, must be a string or a list of 1 to 1024 items",
         "input"),
        ({"input": "x", "include": ["everything"]}, "include.0: Input should be", "include.0"),
        ({"input": "x", "tools": [{"type": "function", "name": "a b"}]},
         "tools: Value error, tool 0: name: String should match pattern", "tools"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "a b", "arguments": "{}"}]},
         "input: Value error, item 0: name: String should match pattern", "input"),
        ({"input": [{"role": "user", "content": "a", "id": "fco_1"},
                    {"type": "function_call_output", "call_id": "c", "output": "b",
                     "id": "fco_1"}]},
         "input: Value error, Duplicate item found with id fco_1. Remove duplicate items", "input"),
    ],
)  # fmt: skip
def test_a_wrong_request_is_a_400_naming_the_field(data, message, param) -> None:
    got_message, got_param = refusal(data)
    assert got_message.startswith(message), got_message
    assert got_param == param


def test_a_named_tool_choice_must_name_a_tool() -> None:
    message, _ = refusal(
        {"input": "x", "tools": [{"type": "function", "name": "f"}],
         "tool_choice": {"type": "function", "name": "g"}}
    )  # fmt: skip
    assert "tool_choice names 'g', which is not in tools" in message


def test_reprs_hide_the_content() -> None:
    body = CreateResponseBody.model_validate({"model": "m", "input": "secret words"})
    assert "secret" not in repr(body) and "secret" not in repr(body.items()[0])
