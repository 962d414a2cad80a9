"""A Responses request (and the stored conversation before it) as a chat completion request
(``gateway.responses.to_chat``), and the input as stored items (``gateway.responses.items``):
exact messages and fields; stored items valid as OpenAI's ``ItemResource``; a stored answer read
back as the next turn's history."""

from __future__ import annotations

from typing import Any, Literal

from openai_contract import check
from responses_helpers import env, passthrough

from gateway.openai.schemas import ChatCompletionBody
from gateway.responses.chat_stream import ChatToResponses
from gateway.responses.items import page, stored_input
from gateway.responses.schemas import CreateResponseBody
from gateway.responses.to_chat import chat_body, chat_messages

TOOL = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}


def _body(**data: Any) -> CreateResponseBody:
    return CreateResponseBody.model_validate({"model": "m", **data})


def test_a_string_input_with_instructions() -> None:
    body = _body(input="hello", instructions="be short")
    assert chat_messages(body) == [
        {"role": "system", "content": "be short"},
        {"role": "user", "content": "hello"},
    ]


def test_items_become_messages_as_vllm_renders_them() -> None:
    body = _body(
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "a"},
                    {"type": "input_text", "text": "b"},
                ],
            },
            {"role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "f", "arguments": '{"x":1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "one"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "two"}],
            },
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "hmm"}],
            },
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": "https://x/i.png", "detail": "low"}
                ],
            },
        ],
        tools=[TOOL],
    )
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": '{"x":1}'}},
    ]
    assert chat_messages(body) == [
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "calling", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": None, "refusal": "no"},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": "https://x/i.png", "detail": "low"}}
            ],
        },
    ]


def test_fields_map_to_their_chat_names_and_the_gateways_stay_home() -> None:
    body = _body(
        input="q",
        tools=[TOOL],
        tool_choice={"type": "function", "name": "f"},
        text={
            "format": {
                "type": "json_schema",
                "name": "o",
                "schema": {"type": "object"},
                "strict": True,
            }
        },
        reasoning={"effort": "high"},
        max_output_tokens=99,
        temperature=0.1,
        top_p=0.5,
        parallel_tool_calls=False,
        stream=True,
        store=True,
        metadata={"k": "v"},
        previous_response_id="resp_1",
        user="u",
    )
    chat = chat_body(body)
    assert isinstance(chat, ChatCompletionBody)
    assert chat.model_dump(exclude_unset=True, exclude={"messages"}) == {
        "model": "m",
        "tools": [
            {
                "type": "function",
                "function": {"name": "f", "description": "d", "parameters": {"type": "object"}},
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "o", "schema": {"type": "object"}, "strict": True},
        },
        "reasoning_effort": "high",
        "max_completion_tokens": 99,
        "temperature": 0.1,
        "top_p": 0.5,
        "parallel_tool_calls": False,
        "stream": True,
        "user": "u",
    }


def test_stored_input_items_are_item_resources() -> None:
    body = _body(
        input=[
            {"role": "user", "content": "plain"},
            {"role": "assistant", "content": "said"},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
        ]
    )
    items = stored_input(body)
    for item in items:
        check("ItemResource", item)
    assert [item["id"][:3] for item in items] == ["msg", "msg", "fc_", "fco", "rs_"]
    assert items[0]["content"] == [{"type": "input_text", "text": "plain"}]
    listing = page(items, limit=2)
    check("ResponseItemList", listing)
    assert [i["id"] for i in listing["data"]] == [items[4]["id"], items[3]["id"]]
    assert listing["has_more"] is True
    rest = page(items, limit=10, after=listing["last_id"])
    assert [i["id"] for i in rest["data"]] == [i["id"] for i in items[2::-1]]
    assert rest["has_more"] is False
    assert page(items, order="asc", limit=1)["first_id"] == items[0]["id"]
    check("ResponseItemList", page([], limit=5))


def test_a_stored_answer_is_the_next_turns_history() -> None:
    machine = ChatToResponses(env(), passthrough, stream=False)
    machine.whole_answer(
        {
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls",
                    "message": {
                        "content": "let me look",
                        "tool_calls": [
                            {
                                "id": "c7",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{}"},
                            }
                        ],
                    },
                }
            ]
        }
    )
    assert machine.response is not None
    first = _body(input="weather?")
    history = [*stored_input(first), *machine.response["output"]]
    second = _body(
        input=[{"type": "function_call_output", "call_id": "c7", "output": "sunny"}], tools=[TOOL]
    )
    call = {"id": "c7", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assert chat_messages(second, history) == [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "let me look", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c7", "content": "sunny"},
    ]


def _walk(items: list[dict[str, Any]], *, limit: int, order: Literal["asc", "desc"]) -> list[int]:
    """Every page, each asked for after the last item's id of the one before (as OpenAI's SDKs
    page); at most one page per item: a listing that goes round is a failure, not a hang."""
    listed: list[int] = []
    after = None
    for _ in range(len(items)):
        listing = page(items, limit=limit, after=after, order=order)
        check("ResponseItemList", listing)
        listed += [int(item["content"][0]["text"]) for item in listing["data"]]
        if not listing["has_more"]:
            return listed
        after = listing["data"][-1]["id"]
    raise AssertionError(f"no end after {len(items)} pages: {listed}")


def test_a_turn_with_a_repeated_item_id_lists_every_item_once_and_ends() -> None:
    """A turn stored with a client's item id repeated (refused since, as OpenAI does): ``after``
    names the first item with its id, so every page ends on such an item -- each item listed
    once, in order, and the listing ends (one ending on a repeat sent the next page back)."""
    for ids in (["C", "X", "B", "X", "A"], ["A", "X", "X", "C"], ["X", "X", "X"], ["A", "B"]):
        items = [
            {"id": item_id, "type": "message", "role": "user", "status": "completed",
             "content": [{"type": "input_text", "text": str(n)}]}
            for n, item_id in enumerate(ids)
        ]  # fmt: skip
        for order in ("asc", "desc"):
            expected = list(range(len(ids))) if order == "asc" else list(range(len(ids)))[::-1]
            for limit in range(1, len(ids) + 2):
                assert _walk(items, limit=limit, order=order) == expected, (ids, order, limit)
