"""Structured-output and tool-call cases, and their checks, shared by the engine's tests.

The schemas are made for random-weight models: every string is an enum and every number bounded,
so the grammar's language is finite and its longest answer has ``LONGEST_*`` characters (the
tools' parameters leave out ``additionalProperties``: ``strict`` refuses properties they do not
name, and the prompt stays short). Each token of a constrained answer adds at least one byte,
so ``max_tokens`` = that length + 1 (for the stop token) lets every answer end "stop" however
the model samples: an answer that ends "length" or does not validate is a defect, never bad
luck.

``answers(url, model, body, count)`` asks for ``count`` answers at once (requests of ``n``
choices, sent concurrently, so the engine batches them) and returns each choice's message,
assembled from the stream when ``stream`` is set (content deltas joined; tool calls by ``index``:
the first delta carries ``id``, ``type`` and ``function.name``, later ones append arguments).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import jsonschema

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        "owner": {
            "type": "object",
            "properties": {"role": {"enum": ["a", "b"]}, "ok": {"type": "boolean"}},
            "required": ["role", "ok"],
            "additionalProperties": False,
        },
    },
    "required": ["kind", "count", "tags", "owner"],
    "additionalProperties": False,
}
LONGEST_SCHEMA_ANSWER = json.dumps(
    {"kind": "cat", "count": 9, "tags": [False, False], "owner": {"role": "a", "ok": False}}
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Rome"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
        },
    },
}
TOOLS = [WEATHER, TIME]
LONGEST_REQUIRED_ANSWER = json.dumps(
    [{"name": "get_weather", "arguments": {"city": "Paris", "days": 7}}]
)
MESSAGES = [{"role": "user", "content": "Tell me about the weather."}]
PER_REQUEST = 10  # choices per request (n)


def schema_body() -> dict[str, Any]:
    return {
        "messages": MESSAGES,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True},
        },
        "max_tokens": len(LONGEST_SCHEMA_ANSWER.encode()) + 1,
    }


def required_body() -> dict[str, Any]:
    return {
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": len(LONGEST_REQUIRED_ANSWER.encode()) + 1,
    }


async def _one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    if not body.get("stream"):
        response = await client.post(url, json=body)
        assert response.status_code == 200, response.text
        return [
            {**choice["message"], "finish_reason": choice["finish_reason"]}
            for choice in response.json()["choices"]
        ]
    messages: dict[int, dict[str, Any]] = {}
    async with client.stream("POST", url, json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                _merge(messages.setdefault(choice["index"], {"content": ""}), choice)
    return [messages[i] for i in sorted(messages)]


def _merge(message: dict[str, Any], choice: dict[str, Any]) -> None:
    delta = choice["delta"]
    message["content"] += delta.get("content") or ""
    for call in delta.get("tool_calls") or []:
        calls = message.setdefault("tool_calls", [])
        if "id" in call:  # the call's first delta
            assert call["index"] == len(calls) and call["type"] == "function", call
            calls.append({"id": call["id"], "function": dict(call["function"])})
        else:
            calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    if choice["finish_reason"] is not None:
        message["finish_reason"] = choice["finish_reason"]


async def _answers(url: str, body: dict[str, Any], count: int) -> list[dict[str, Any]]:
    requests = [{**body, "n": min(PER_REQUEST, count - i)} for i in range(0, count, PER_REQUEST)]
    async with httpx.AsyncClient(timeout=300) as client:
        found = await asyncio.gather(*(_one(client, url, b) for b in requests))
    return [message for group in found for message in group]


def answers(url: str, model: str, body: dict[str, Any], count: int) -> list[dict[str, Any]]:
    return asyncio.run(_answers(url + "/v1/chat/completions", {"model": model, **body}, count))


def both_ways(url: str, model: str, body: dict[str, Any], count: int) -> list[list[dict[str, Any]]]:
    """``count`` answers streamed and ``count`` not, all in flight together."""

    async def run() -> list[list[dict[str, Any]]]:
        chat = url + "/v1/chat/completions"
        asks = (_answers(chat, {"model": model, **body, "stream": s}, count) for s in (False, True))
        return list(await asyncio.gather(*asks))

    return asyncio.run(run())


def check_schema_answers(messages: list[dict[str, Any]], count: int) -> None:
    """Every answer ended "stop" and its content validates against SCHEMA."""
    assert len(messages) == count
    for message in messages:
        assert message["finish_reason"] == "stop", message
        assert not message.get("tool_calls"), message
        jsonschema.validate(json.loads(message["content"]), SCHEMA)


def check_required_answers(messages: list[dict[str, Any]], count: int) -> None:
    """Every answer is one call of a tool the request offered, its arguments valid under the
    tool's parameters, finish reason "tool_calls"."""
    assert len(messages) == count
    by_name = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for message in messages:
        assert message["finish_reason"] == "tool_calls", message
        assert not message.get("content"), message
        (call,) = message["tool_calls"]
        assert call["id"].startswith("call_")
        name = call["function"]["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), by_name[name])
