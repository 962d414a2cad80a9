"""The OpenAI request surface at the door: every published field is read and decided by one
table (``gateway.openai.surface``), rendered into gateway/README.md; what an engine kind does not
take is a 400 naming the field and the engine before the request touches the tenant's limits; what
asks for nothing is accepted and left out; a request goes only to engines that take all of it."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from gateway_harness import Gateway, bearer, running_gateway
from gateway_standin import StandInEngine, start_standin
from openai_contract import check, request_fields
from pydantic import ValidationError

from backend.server.openai_schema import ChatCompletionRequest, CompletionRequest
from gateway.engines.registry import EngineRecord, EngineSource
from gateway.engines.spec import EngineSpec
from gateway.openai import surface
from gateway.openai.schemas import ChatCompletionBody, CompletionBody

MODEL = "standin-model"
CHAT = "/v1/chat/completions"
README = Path(__file__).parents[3] / "gateway" / "README.md"
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize(
    ("schema", "body"),
    [
        ("CreateChatCompletionRequest", ChatCompletionBody),
        ("CreateCompletionRequest", CompletionBody),
    ],
)
def test_every_published_request_field_is_read_and_decided(schema: str, body: type) -> None:
    published = request_fields(schema)
    assert published - set(body.model_fields) == set()  # none is refused as unknown
    assert published - set(surface.RULES) == set()  # each has its row in the table
    # and the gateway adds only vLLM/SGLang's cache_salt (accepted, never forwarded)
    assert set(body.model_fields) - published == {"cache_salt"}


def test_the_readme_table_is_rendered_from_the_deciding_code() -> None:
    text = README.read_text(encoding="utf-8")
    found = re.search(r"<!-- surface-table:start -->\n(.*?)<!-- surface-table:end -->", text, re.S)
    assert found is not None, "gateway/README.md lost its surface table markers"
    assert found.group(1) == surface.render_markdown(), "run: python -m gateway.openai.surface"


async def test_a_refused_field_is_a_400_naming_field_and_engine_kind_before_any_limit(
    gateway: Gateway, standin: StandInEngine
) -> None:
    _, key = await gateway.create_tenant("acme", requests_per_minute=1)
    for body in (
        _chat(tools=[TOOL]),
        _chat(response_format={"type": "json_object"}),
        {"model": MODEL, "messages": [{"role": "tool", "content": "4", "tool_call_id": "c1"}]},
        _chat(store=True),
        {"model": MODEL, "prompt": ["a", "b"]},
    ):
        path = CHAT if "messages" in body else "/v1/completions"
        r = await gateway.client.post(path, json=body, headers=bearer(key))
        assert r.status_code == 400, r.text
        error = check("ErrorResponse", r.json())["error"]
        assert error["code"] == "unsupported_parameter"
        assert "this model's engine (bundled)" in error["message"]
        assert "standin" not in error["message"] and "127.0.0.1" not in error["message"]
        assert error["param"] in body
    assert standin.controls.seen_bodies == []
    # None of the refusals took the one request this minute allows.
    assert (await gateway.client.post(CHAT, json=_chat(), headers=bearer(key))).status_code == 200


async def test_values_that_ask_for_nothing_are_accepted_and_left_out(
    gateway: Gateway, standin: StandInEngine
) -> None:
    _, key = await gateway.create_tenant("acme")
    inert = {
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "store": False,
        "modalities": ["text"],
        "service_tier": "auto",
        "metadata": {"team": "search"},
        "safety_identifier": "user-1",
    }
    r = await gateway.client.post(CHAT, json=_chat(**inert, n=2, seed=3), headers=bearer(key))
    assert r.status_code == 200, r.text
    seen = standin.controls.seen_bodies[-1]
    assert set(inert) & set(seen) == set()
    assert (seen["n"], seen["seed"]) == (2, 3)  # the bundled engine takes these


@pytest.fixture
async def two_kinds(
    make_settings: Any,
) -> AsyncIterator[tuple[Gateway, StandInEngine, StandInEngine]]:
    bundled, declared = await start_standin(), await start_standin()
    engines = [
        {"name": "bundled", "kind": "bundled", "base_url": bundled.url},
        {
            "name": "declared",
            "kind": "openai",
            "base_url": declared.url,
            "model": MODEL,
            "declared_max_model_len": 4096,
            "allow_unverified": True,
        },
    ]
    try:
        async with running_gateway(make_settings(engines=engines)) as gw:
            yield gw, bundled, declared
    finally:
        await bundled.stop()
        await declared.stop()


async def test_a_request_goes_only_to_an_engine_that_takes_all_of_it(two_kinds: Any) -> None:
    gateway, bundled, declared = two_kinds
    _, key = await gateway.create_tenant("acme")
    for _ in range(4):
        r = await gateway.client.post(CHAT, json=_chat(tools=[TOOL]), headers=bearer(key))
        assert r.status_code == 200, r.text
    assert bundled.controls.seen_bodies == []
    assert [b["tools"] for b in declared.controls.seen_bodies] == [[TOOL]] * 4
    # metadata is taken by both (not forwarded by either); safety_identifier goes to openai only
    body = _chat(metadata={"k": "v"}, safety_identifier="u1")
    for _ in range(4):
        assert (await gateway.client.post(CHAT, json=body, headers=bearer(key))).status_code == 200
    assert all("metadata" not in b for b in bundled.controls.seen_bodies)
    assert all("safety_identifier" not in b for b in bundled.controls.seen_bodies)
    sent = [b for b in declared.controls.seen_bodies if "safety_identifier" in b]
    assert all("metadata" not in b for b in sent)
    assert len(bundled.controls.seen_bodies) + len(sent) == 4


# A sample value for each row the bundled engine is forwarded, with what else it needs.
USER = {"role": "user", "content": "hi"}
SAMPLES: dict[str, tuple[Any, dict[str, Any]]] = {
    "model": (MODEL, {}),
    "messages": ([USER], {}),
    "prompt": ("hi", {}),
    "stream": (True, {}),
    "stream_options": ({"include_usage": True}, {"stream": True}),
    "max_tokens": (5, {}),
    "max_completion_tokens": (5, {}),
    "temperature": (0.5, {}),
    "top_p": (0.9, {}),
    "seed": (3, {}),
    "stop": (["\n"], {}),
    "n": (2, {}),
    "user": ("u1", {}),
    "presence_penalty": (0.5, {}),
    "frequency_penalty": (-0.5, {}),
    "logit_bias": ({"65": 1.0}, {}),
    "logprobs": (True, {}),
    "top_logprobs": (2, {"logprobs": True}),
    "parallel_tool_calls": (False, {}),
}
COMPLETIONS_SAMPLES = {"logprobs": 2}  # an integer there (alternatives per token)
# Message features: a message using it, and the same message with its nullable members null.
MESSAGE_FEATURES = {
    "messages: developer role": {"role": "developer", "content": "be brief"},
    "messages: text content parts": {"role": "user", "content": [{"type": "text", "text": "x"}]},
}
NULL_MEMBERS = {"name": None, "refusal": None, "tool_calls": None, "function_call": None}
# Assistant turns as SDKs echo them back (``message.model_dump()``): nulls for what is absent.
ECHOED = [
    {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None},
    {"role": "assistant", "content": None, "refusal": None, "audio": None, "function_call": None},
    {"role": "assistant", "content": "hi", "name": None, "tool_call_id": None},
]
GATEWAY_SET = {"max_tokens", "stream", "stream_options"}  # the gateway sends its own
BUNDLED_ROWS = [
    r.field
    for r in surface.TABLE
    if r.decision(surface.Profile.BUNDLED) is surface.Decision.FORWARD
]
BUNDLED = EngineRecord(EngineSpec(name="tiny", base_url="http://127.0.0.1:1"), EngineSource.CONFIG)


def _forwarded(body: dict[str, Any]) -> tuple[dict[str, Any], type[Any]] | None:
    """What the gateway sends the bundled engine for ``body`` and the engine's request model, or
    None when the gateway refuses it at the door."""
    gateway, engine = (
        (ChatCompletionBody, ChatCompletionRequest)
        if "messages" in body
        else (CompletionBody, CompletionRequest)
    )
    try:
        parsed = gateway.model_validate(body)
    except ValidationError:
        return None
    if surface.refusal(surface.requested(parsed), BUNDLED) is not None:
        return None
    return surface.for_engine(parsed.upstream_body(max_tokens=8), BUNDLED), engine


def _bodies(row: str) -> list[tuple[dict[str, Any], bool]]:
    """(request, must the door accept it): the row's sample and its null, on each endpoint that
    has the field."""
    if row in MESSAGE_FEATURES:
        message = MESSAGE_FEATURES[row]
        return [
            ({"model": MODEL, "messages": [message]}, True),
            ({"model": MODEL, "messages": [{**message, **NULL_MEMBERS}]}, True),
        ]
    value, needs = SAMPLES[row]
    bases = []
    if row in ChatCompletionBody.model_fields:
        bases.append(({"model": MODEL, "messages": [USER], **needs}, value))
    if row in CompletionBody.model_fields:
        bases.append(
            ({"model": MODEL, "prompt": "hi", **needs}, COMPLETIONS_SAMPLES.get(row, value))
        )
    required = row in ("model", "messages", "prompt")
    return [
        body
        for base, sample in bases
        for body in (({**base, row: sample}, True), ({**base, row: None}, not required))
    ]


def test_the_sample_table_covers_every_row_forwarded_to_the_bundled_engine() -> None:
    assert set(BUNDLED_ROWS) == set(SAMPLES) | set(MESSAGE_FEATURES)


@pytest.mark.parametrize("row", BUNDLED_ROWS)
def test_what_the_door_lets_in_for_the_bundled_engine_it_takes(row: str) -> None:
    """A sample value and an explicit null (which OpenAI's schemas allow for every optional field,
    and SDKs send for a None): what the gateway accepts, the bundled engine's request model
    accepts as the gateway forwards it (no engine process: the engine's own schema)."""
    for body, accepted in _bodies(row):
        forwarded = _forwarded(body)
        if forwarded is None:
            assert not accepted, f"the door refused {body}"
            continue
        sent, engine = forwarded
        engine.model_validate(sent)  # raises naming the field the engine refuses
        if body.get(row, True) is None and row not in GATEWAY_SET:
            assert row not in sent  # a null is not given: nothing forwarded for it


@pytest.mark.parametrize("message", ECHOED)
def test_assistant_turns_echoed_with_nulls_pass_both_sides(message: dict[str, Any]) -> None:
    forwarded = _forwarded({"model": MODEL, "messages": [USER, message, USER]})
    assert forwarded is not None
    sent, engine = forwarded
    engine.model_validate(sent)
    assert all(None not in m.values() for m in sent["messages"])


@pytest.mark.slow
async def test_nulls_through_the_gateway_to_the_real_bundled_engine(
    engine_factory: Any, make_settings: Any
) -> None:
    """What an SDK sends for Nones, and an assistant turn echoed back: a 200 from a real engine."""
    url = await anyio.to_thread.run_sync(lambda: engine_factory(pool_tokens=512, page_size=16))
    settings = make_settings(engines=[{"name": "tiny", "kind": "bundled", "base_url": url}])
    async with running_gateway(settings) as gw:
        _, key = await gw.create_tenant("acme")
        models = (await gw.client.get("/v1/models", headers=bearer(key))).json()["data"]
        nulls = dict.fromkeys(
            ["temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "logprobs"]
            + ["top_logprobs", "seed", "stop", "user", "logit_bias", "stream_options", "stream"]
        )
        messages = [
            {"role": "user", "content": "hi", "name": None},
            {"role": "assistant", "content": None, "refusal": None, "tool_calls": None},
            {"role": "assistant", "content": "hello", "refusal": None, "tool_calls": None},
            {"role": "user", "content": "again"},
        ]
        body = {"model": models[0]["id"], "messages": messages, "max_tokens": 4, **nulls}
        r = await gw.client.post(CHAT, json=body, headers=bearer(key))
        assert r.status_code == 200, r.text
        check("CreateChatCompletionResponse", r.json())
        body = {"model": models[0]["id"], "prompt": "hi", "max_tokens": 4, **nulls}
        body.pop("top_logprobs")
        r = await gw.client.post("/v1/completions", json=body, headers=bearer(key))
        assert r.status_code == 200, r.text
        check("CreateCompletionResponse", r.json())


async def test_a_text_part_with_keys_the_schema_lacks_is_refused_at_the_door(
    gateway: Gateway, standin: StandInEngine
) -> None:
    """OpenAI's text part is ``type`` and ``text``; the bundled engine refuses any other key, so
    the door does too (a provider extension such as ``cache_control`` used to pass the door and
    then fail at the engine)."""
    _, key = await gateway.create_tenant("acme", requests_per_minute=1)
    part = {"type": "text", "text": "hello", "cache_control": {"type": "ephemeral"}}
    body = {"model": MODEL, "messages": [{"role": "user", "content": [part]}]}
    r = await gateway.client.post(CHAT, json=body, headers=bearer(key))
    assert r.status_code == 400, r.text
    error = check("ErrorResponse", r.json())["error"]
    assert "cache_control" in error["message"] and error["param"].startswith("messages")
    assert standin.controls.seen_bodies == []
    # the refusal did not take the one request this minute allows
    assert (await gateway.client.post(CHAT, json=_chat(), headers=bearer(key))).status_code == 200


def _bundled_reporting(*features: str) -> EngineRecord:
    from gateway.engines.capacity import CapacitySnapshot, RoleView

    record = EngineRecord(
        EngineSpec(name="tiny", base_url="http://127.0.0.1:1"), EngineSource.CONFIG
    )
    roles = (RoleView("unified", 4096),)
    record.snapshot = CapacitySnapshot(MODEL, 4096, roles, True, features=frozenset(features))
    return record


CALL = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
REPORTED_BODIES = {
    "tools": _chat(tools=[TOOL]),
    "tool_choice": _chat(tools=[TOOL], tool_choice="required"),
    "response_format": _chat(response_format={"type": "json_object"}),
    "messages: tool role": {
        "model": MODEL,
        "messages": [
            USER,
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "4"},
        ],
    },
}


@pytest.mark.parametrize("row", sorted(REPORTED_BODIES))
def test_a_reported_feature_is_forwarded_and_its_absence_refused(row: str) -> None:
    """Tools and structured output reach a bundled engine that reports them in its capacity (and
    its own request schema takes them as forwarded); one that does not is refused at the door,
    naming the missing report."""
    body = ChatCompletionBody.model_validate(REPORTED_BODIES[row])
    fields = surface.requested(body)
    feature = surface.RULES[row].feature
    assert feature is not None
    reporting = _bundled_reporting("tools", "structured_output")
    assert surface.refusal(fields, reporting) is None
    sent = surface.for_engine(body.upstream_body(max_tokens=8), reporting)
    ChatCompletionRequest.model_validate(sent)
    assert (row in sent) or row.startswith("messages")
    silent = _bundled_reporting()
    refused = surface.refusal(fields, silent)
    assert refused is not None and f"does not report '{feature}'" in str(refused)
