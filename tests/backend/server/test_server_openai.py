"""The engine's OpenAI surface over real HTTP: n choices, logprobs, penalties, logit_bias, content
parts, the developer role, the default max_tokens, and tools/structured output refused; every
answer and stream event validated against OpenAI's published schemas (tests/openapi)."""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai_contract import check, check_sse

from kvguard.testing import EngineProcess, launch_engine

POOL_TOKENS = 256
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: str) -> Iterator[EngineProcess]:
    proc = launch_engine(
        tiny_checkpoint,
        pool_tokens=POOL_TOKENS,
        page_size=16,
        env={"KVGUARD_SERVED_MODEL_NAME": MODEL},
    )
    yield proc
    proc.stop()


def _post(engine: EngineProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(engine.url + path, json={"model": MODEL, **body}, timeout=60)


def _chat(engine: EngineProcess, **fields: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, **fields}
    return _post(engine, "/v1/chat/completions", body)


def _token_bytes(entries: list[dict[str, Any]]) -> str:
    """The text of the entries' bytes; a character cut by max_tokens is no text (the engine
    leaves it out rather than send U+FFFD), so decode incrementally, without a final flush."""
    data = bytes(b for entry in entries for b in entry["bytes"])
    return str(codecs.getincrementaldecoder("utf-8")("replace").decode(data))


def test_chat_answer_with_n_choices_and_logprobs_matches_the_schema(engine: EngineProcess) -> None:
    response = _chat(engine, n=3, logprobs=True, top_logprobs=2, seed=5, temperature=1.0)
    assert response.status_code == 200, response.text
    body = check("CreateChatCompletionResponse", response.json())
    assert body["id"].startswith("chatcmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    generated = 0
    for choice in body["choices"]:
        assert choice["message"]["refusal"] is None
        content = choice["logprobs"]["content"]
        assert choice["logprobs"]["refusal"] is None
        assert all(len(entry["top_logprobs"]) == 2 for entry in content)
        assert _token_bytes(content) == choice["message"]["content"]  # one entry per text token
        generated += len(content) + (choice["finish_reason"] == "stop")  # EOS has no entry
    assert body["usage"]["completion_tokens"] == generated
    again = _chat(engine, n=3, logprobs=True, top_logprobs=2, seed=5, temperature=1.0).json()
    assert [c["message"] for c in again["choices"]] == [c["message"] for c in body["choices"]]
    texts = {c["message"]["content"] for c in body["choices"]}
    assert len(texts) > 1, "choice i is seeded with seed + i: the choices differ"


def test_greedy_logprobs_name_the_argmax(engine: EngineProcess) -> None:
    body = _chat(engine, logprobs=True, top_logprobs=3, temperature=0).json()
    for entry in body["choices"][0]["logprobs"]["content"]:
        best = entry["top_logprobs"][0]
        assert best["bytes"] == entry["bytes"] and best["logprob"] == entry["logprob"]


def test_streamed_choices_each_end_and_every_chunk_matches_the_schema(
    engine: EngineProcess,
) -> None:
    response = _chat(
        engine,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=1,
        temperature=1.0,
        seed=1,
    )
    assert response.status_code == 200
    events = check_sse(response.content, "CreateChatCompletionStreamResponse")
    texts: dict[int, str] = {0: "", 1: ""}
    logprobs: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    finished = []
    for event in events[:-1]:
        [choice] = event["choices"]
        assert event["id"].startswith("chatcmpl-")
        texts[choice["index"]] += choice["delta"].get("content", "")
        logprobs[choice["index"]] += (choice["logprobs"] or {}).get("content") or []
        if choice["finish_reason"] is not None:
            finished.append(choice["index"])
    assert sorted(finished) == [0, 1]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] > 0
    for index in (0, 1):
        assert _token_bytes(logprobs[index]) == texts[index]


def test_completion_logprobs_in_the_legacy_shape(engine: EngineProcess) -> None:
    response = _post(
        engine, "/v1/completions", {"prompt": "abc", "max_tokens": 5, "logprobs": 2, "n": 2}
    )
    body = check("CreateCompletionResponse", response.json())
    assert body["id"].startswith("cmpl-")
    for choice in body["choices"]:
        lp = choice["logprobs"]
        n = len(lp["tokens"])
        assert len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
        assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
        assert all(len(top) <= 2 for top in lp["top_logprobs"])


def test_logit_bias_forces_a_token(engine: EngineProcess) -> None:
    body = _chat(engine, temperature=0, logit_bias={"65": 100}, max_tokens=4).json()
    assert body["choices"][0]["message"]["content"] == "AAAA"
    refused = _chat(engine, logit_bias={"100000": 1})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "logit_bias"


def test_penalties_are_served(engine: EngineProcess) -> None:
    # +100 on 'A' and 'B' alike leaves the choice between them to the model's own logits, which
    # differ by far less than 2 here: a presence penalty of -2 makes the first one win for good,
    # one of +2 makes them alternate.
    bias = {"65": 100, "66": 100}
    texts = {}
    for penalty in (-2, 2):
        body = _chat(engine, temperature=0, logit_bias=bias, max_tokens=6, presence_penalty=penalty)
        texts[penalty] = body.json()["choices"][0]["message"]["content"]
    assert texts[-2] in ("AAAAAA", "BBBBBB")
    assert texts[2] in ("ABABAB", "BABABA")
    frequency = _chat(engine, temperature=0, logit_bias=bias, max_tokens=6, frequency_penalty=-2)
    assert frequency.json()["choices"][0]["message"]["content"] in ("AAAAAA", "BBBBBB")
    zeros = _chat(engine, presence_penalty=0, frequency_penalty=0)
    assert zeros.status_code == 200


def test_developer_role_and_text_parts_are_the_same_prompt(engine: EngineProcess) -> None:
    plain = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb"}]
    parts = [
        {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ]
    counts = [_post(engine, "/tokenize", {"messages": m}).json()["count"] for m in (plain, parts)]
    assert counts[0] == counts[1]
    answers = [
        _post(engine, "/v1/chat/completions", {"messages": m, "max_tokens": 5, "temperature": 0})
        for m in (plain, parts)
    ]
    assert answers[0].json()["choices"] == answers[1].json()["choices"]


def test_without_max_tokens_a_choice_may_use_what_fits(engine: EngineProcess) -> None:
    body = _post(engine, "/v1/completions", {"prompt": "x" * 100, "temperature": 0}).json()
    used = body["usage"]["total_tokens"]
    assert body["choices"][0]["finish_reason"] == "stop" or used == POOL_TOKENS, body["usage"]
    assert body["usage"]["completion_tokens"] > 16  # the old default stopped at 16


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"$ref": "#/missing"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop"),
        ({"messages": [{"role": "tool", "content": "4"}]}, "messages"),
    ],
)
def test_malformed_tools_and_structured_output_are_a_400_naming_the_field(
    engine: EngineProcess, fields: dict[str, Any], param: str
) -> None:
    response = _chat(engine, **fields)
    assert response.status_code == 400, response.text
    error = check("ErrorResponse", response.json())["error"]
    assert error["param"] == param or param in error["message"], error


def test_fields_that_ask_for_nothing_are_accepted(engine: EngineProcess) -> None:
    messages = [{"role": "user", "content": "hello"}]
    response = _post(
        engine,
        "/v1/chat/completions",
        {
            "messages": messages,
            "tools": [],
            "tool_choice": "none",
            "parallel_tool_calls": False,
            "response_format": {"type": "text"},
            "max_completion_tokens": 3,
            "user": "someone",
        },
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] <= 3


@pytest.mark.parametrize(
    ("message", "needle"),
    [
        ({"role": "user", "content": "42", "tool_call_id": "x"}, "needs tool_call_id"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {}}]}, "text parts only"),
        ({"role": "user", "content": [{"type": "text"}]}, "a text part is"),
    ],
)
def test_messages_this_engine_cannot_read_are_refused(
    engine: EngineProcess, message: dict[str, Any], needle: str
) -> None:
    response = _post(engine, "/v1/chat/completions", {"messages": [message]})
    assert response.status_code == 400
    assert needle in check("ErrorResponse", response.json())["error"]["message"]


def test_top_logprobs_needs_logprobs(engine: EngineProcess) -> None:
    assert _chat(engine, top_logprobs=2).status_code == 400
    assert _chat(engine, n=17).status_code == 400


def test_model_card_by_id(engine: EngineProcess) -> None:
    card = httpx.get(f"{engine.url}/v1/models/{MODEL}", timeout=10)
    assert card.status_code == 200
    assert check("Model", card.json())["id"] == MODEL
    check("ListModelsResponse", httpx.get(f"{engine.url}/v1/models", timeout=10).json())
    missing = httpx.get(f"{engine.url}/v1/models/other", timeout=10)
    assert missing.status_code == 404
    assert check("ErrorResponse", missing.json())["error"]["code"] == "model_not_found"


def test_error_events_and_bodies_match_the_schema(engine: EngineProcess) -> None:
    too_long = _post(engine, "/v1/completions", {"prompt": "x" * 300, "stream": True})
    assert too_long.status_code == 400
    check("ErrorResponse", json.loads(too_long.content))
