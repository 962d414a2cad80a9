"""The Responses API through the gateway with the official ``openai`` SDK, unchanged: the real
bundled engine (a ``kvguard backend unified`` process, translated through chat completions) and
the vLLM stand-in that serves ``/v1/responses`` itself (``standin_vllm_responses``, vLLM 0.33.0).
Every answer and every streamed event the gateway sends is validated against OpenAI's published
schemas (tests/openapi). Both engines: create (plain, streamed with ``responses.stream()``, with
function tools), retrieve, input_items, a two-turn ``previous_response_id`` conversation, delete;
what a native engine receives (never the client's previous_response_id or store); the canary's
marker reaching both kinds of engine, and a leak in a Responses stream cut as a failed response."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gateway_standin import MODEL as STANDIN_MODEL
from gateway_standin import StandInEngine
from openai_contract import check, check_response_event, check_response_events
from sqlalchemy import create_engine, select
from standin_openai import Script, ToolCall
from standin_vllm_responses import VLLMResponses, serve_vllm

from canary.config import CanarySettings
from canary.runtime import CanaryRuntime
from gateway.app import create_app
from gateway.db.models import RequestAudit
from kvguard.testing import EngineProcess, RunningServer, launch_engine, serve

BUNDLED_PATH = Path(__file__).resolve().parents[3] / "backend" / "bundled" / "kvguard-tiny"
BUNDLED_MODEL = "kvguard-tiny"
CANARY_KEY = "sdk-test-canary-key-0123456789abcdef0123"
MARKER = re.compile(r"CNRY-[A-Z2-7]{32}")
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "the weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProcess]:
    """The bundled engine as ``make up`` runs it: the bundled model, which answers and stops."""
    proc = launch_engine(
        str(BUNDLED_PATH),
        pool_tokens=1024,
        page_size=16,
        env={"KVGUARD_SERVED_MODEL_NAME": BUNDLED_MODEL},
    )
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def pd_pair() -> Iterator[EngineProcess]:
    """The bundled engine as a prefill/decode pair (the decode is the entry point)."""
    env = {"KVGUARD_SERVED_MODEL_NAME": BUNDLED_MODEL}
    prefill = launch_engine(str(BUNDLED_PATH), "prefill", env, pool_tokens=1024, page_size=16)
    try:
        decode = launch_engine(
            str(BUNDLED_PATH),
            "decode",
            env,
            pool_tokens=1024,
            page_size=16,
            prefill_url=prefill.url,
        )
    except BaseException:
        prefill.stop()
        raise
    yield decode
    decode.stop()
    prefill.stop()


@dataclass
class Served:
    url: str
    admin: dict[str, str]
    stoppers: list[RunningServer] = field(default_factory=list)

    async def client(self, name: str = "acme", **limits: Any) -> tuple[openai.AsyncOpenAI, str]:
        async with httpx.AsyncClient() as http:
            r = await http.post(
                f"{self.url}/admin/tenants", json={"name": name, **limits}, headers=self.admin
            )
        key = r.json()["key"]["key"]
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key), key

    async def post(self, key: str, body: dict[str, Any]) -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as http:
            return await http.post(
                f"{self.url}/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"}
            )


@pytest.fixture
async def served(make_settings: Any) -> AsyncIterator[Any]:
    started: list[RunningServer] = []

    async def start(engines: list[dict[str, Any]], *, canary: bool = False) -> Served:
        settings = make_settings(engines=engines)
        hooks = CanaryRuntime(CanarySettings(canary_key=CANARY_KEY)).hooks() if canary else None
        server = await serve(create_app(settings, hooks=hooks), lifespan="on")
        started.append(server)
        return Served(server.url, {"Authorization": f"Bearer {settings.admin_secret()}"})

    yield start
    for server in reversed(started):
        await server.stop()


def _events(sdk_events: list[Any]) -> list[str]:
    return [event.type for event in sdk_events]


async def _conversation(
    gw: Served,
    model: str,
    *,
    tools_turn: dict[str, Any],
    before_tools: Callable[[], None] = lambda: None,
) -> None:
    """Everything the done-when line names, against one engine behind ``gw``."""
    client, key = await gw.client()
    # create, whole
    raw = await client.responses.with_raw_response.create(
        model=model,
        input="hello there",
        instructions="answer briefly",
        max_output_tokens=16,
        metadata={"topic": "greeting"},
    )
    first = check("Response", raw.http_response.json())
    created = raw.parse()
    assert created.id == first["id"] and created.id.startswith("resp_")
    assert first["status"] in ("completed", "incomplete") and first["store"] is True
    assert first["metadata"] == {"topic": "greeting"} and first["usage"]["output_tokens"] >= 1

    # retrieve: the Response as the client got it
    fetched = await client.responses.with_raw_response.retrieve(created.id)
    assert check("Response", fetched.http_response.json()) == first
    # input items: OpenAI's list shape, this turn's input
    listed = await client.responses.input_items.with_raw_response.list(created.id)
    page = check("ResponseItemList", listed.http_response.json())
    assert [item["content"][0]["text"] for item in page["data"]] == ["hello there"]
    assert page["first_id"] == page["data"][0]["id"] and page["has_more"] is False

    # a second turn, streamed with responses.stream(), continuing the first
    turn = {"model": model, "input": "and again", "max_output_tokens": 32}
    async with client.responses.stream(**turn, previous_response_id=created.id) as stream:
        seen = [event async for event in stream]
        second = await stream.get_final_response()
    kinds = _events(seen)
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_text.delta" in kinds
    assert second.previous_response_id == created.id
    # the stored history reached the engine: the same input alone is shorter
    alone = await client.responses.create(**turn, store=False)
    assert second.usage is not None and alone.usage is not None
    assert second.usage.input_tokens > alone.usage.input_tokens
    assert (await client.responses.retrieve(second.id)).output_text == second.output_text
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(alone.id)  # store: false kept nothing
    # every event as sent, against the published schemas
    streamed = await gw.post(key, {**turn, "stream": True, "previous_response_id": second.id})
    assert streamed.status_code == 200
    events = check_response_events(streamed.content)
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    check("Response", events[-1]["response"])

    # function tools: a call, then its output sent back as the next turn
    before_tools()
    call_turn = {"model": model, "input": "weather in Oslo?", "tools": [WEATHER], **tools_turn}
    called = await client.responses.with_raw_response.create(**call_turn)
    answer = check("Response", called.http_response.json())
    calls = [item for item in answer["output"] if item["type"] == "function_call"]
    assert [c["name"] for c in calls] == ["get_weather"]
    streamed = await gw.post(key, {**call_turn, "stream": True})
    events = check_response_events(streamed.content)
    kinds = [e["type"] for e in events]
    assert "response.function_call_arguments.done" in kinds
    result = {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": "sunny"}
    followed = await client.responses.with_raw_response.create(
        model=model,
        input=[result],
        tools=[WEATHER],
        previous_response_id=answer["id"],
        max_output_tokens=16,
    )
    check("Response", followed.http_response.json())

    # delete: gone for good
    assert await client.responses.delete(created.id) is None
    for lookup in (client.responses.retrieve, client.responses.delete):
        with pytest.raises(openai.NotFoundError):
            await lookup(created.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.input_items.list(created.id)


async def test_the_sdk_against_the_bundled_engine(engine: EngineProcess, served: Any) -> None:
    gw = await served([{"name": "tiny", "kind": "bundled", "base_url": engine.url}])
    forced = {"tool_choice": {"type": "function", "name": "get_weather"}, "max_output_tokens": 48}
    await _conversation(gw, BUNDLED_MODEL, tools_turn=forced)
    # text.format: the engine's structured output, through chat's response_format
    client, _ = await gw.client("structured")
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 3}},
        "required": ["a"],
        "additionalProperties": False,
    }
    shaped = await client.responses.with_raw_response.create(
        model=BUNDLED_MODEL,
        input="hi",
        text={"format": {"type": "json_schema", "name": "short", "schema": schema}},
        max_output_tokens=32,
    )
    answer = check("Response", shaped.http_response.json())
    assert answer["text"]["format"]["name"] == "short" and answer["status"] == "completed"
    assert set(json.loads(shaped.parse().output_text)) == {"a"}


async def test_a_prefill_decode_pair_serves_it_with_its_handoff_proof(
    pd_pair: EngineProcess, served: Any, sqlite_url: str
) -> None:
    """Behind a prefill/decode pair: whole and streamed, schema-valid, and the handoff proof the
    decode sends with each answer is read and audited (a consistent one: the answer delivered)."""
    gw = await served([{"name": "pd", "kind": "bundled", "base_url": pd_pair.url}])
    client, key = await gw.client()
    raw = await client.responses.with_raw_response.create(
        model=BUNDLED_MODEL, input="hello there", max_output_tokens=32
    )
    first = check("Response", raw.http_response.json())
    streamed = await gw.post(
        key,
        {
            "model": BUNDLED_MODEL,
            "input": "and again",
            "previous_response_id": first["id"],
            "stream": True,
            "max_output_tokens": 32,
        },
    )
    events = check_response_events(streamed.content)
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    db = create_engine(sqlite_url)
    try:
        deadline = time.monotonic() + 30
        while True:
            with db.connect() as conn:
                rows = conn.execute(
                    select(RequestAudit.stream, RequestAudit.handoff_outcome).where(
                        RequestAudit.endpoint == "responses"
                    )
                ).all()
            if len(rows) == 2 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)  # the audit writer's batch (polled, bounded)
    finally:
        db.dispose()
    assert sorted(rows) == [(False, "ok"), (True, "ok")], rows


async def test_the_sdk_against_the_vllm_standin(served: Any) -> None:
    standin = VLLMResponses(enable_store=True)
    server = await serve_vllm(standin)
    try:
        gw = await served([{"name": "vllm", "kind": "vllm", "base_url": server.url}])

        def script_the_call() -> None:  # the stand-in answers a tool call when scripted to
            standin.script = Script(tool_calls=[ToolCall("get_weather", '{"city": "Oslo"}', 4)])

        tools_turn = {"max_output_tokens": 16}
        await _conversation(gw, standin.model, tools_turn=tools_turn, before_tools=script_the_call)
        # the engine never kept the tenant's state: every request stored nothing, carried no
        # previous_response_id or conversation, and sent the whole conversation instead
        assert standin.store == {}
        bodies = standin.traffic.bodies
        assert bodies and all(body["store"] is False for body in bodies)
        assert not any("previous_response_id" in body or "conversation" in body for body in bodies)
        assert any(len(body["input"]) >= 3 for body in bodies if isinstance(body["input"], list))
    finally:
        await server.stop()


async def test_the_canary_marker_reaches_both_kinds_of_engine(
    engine: EngineProcess, served: Any, standin: StandInEngine
) -> None:
    """A sampled tenant's Responses request is marked as its chat is: first in the chat form's
    first system message for a translated engine (the bundled-kind stand-in records it), first in
    ``instructions`` for a native one (vLLM); the tenant never sees its own marker (the bundled
    model, asked for it, copies it: stripped) or the marker's tokens in its usage."""
    vllm = VLLMResponses(enable_store=True)
    server = await serve_vllm(vllm)
    try:
        gw = await served(
            [
                {"name": "tiny", "kind": "bundled", "base_url": engine.url},
                {"name": "recorder", "kind": "bundled", "base_url": standin.url},
                {"name": "vllm", "kind": "vllm", "base_url": server.url},
            ],
            canary=True,
        )
        marked, _ = await gw.client("marked", canary_sample_rate=1.0)
        unmarked, _ = await gw.client("unmarked", canary_sample_rate=0.0)
        ask = {"input": "hi", "instructions": "be kind", "max_output_tokens": 16}
        asked = await marked.responses.create(model=vllm.model, **ask)
        line, rest = vllm.traffic.bodies[-1]["instructions"].split("\n", 1)
        assert MARKER.fullmatch(line) and rest == "be kind"
        assert asked.instructions == "be kind" and "CNRY" not in asked.model_dump_json()
        plain = await unmarked.responses.create(model=vllm.model, **ask)
        assert vllm.traffic.bodies[-1]["instructions"] == "be kind"
        assert plain.usage is not None and asked.usage is not None
        assert plain.usage.input_tokens == asked.usage.input_tokens  # the marker's are hidden
        # translated: the chat form carries it as a chat request does
        await marked.responses.create(model=STANDIN_MODEL, **ask)
        system = standin.controls.seen_bodies[-1]["messages"][0]
        assert system["role"] == "system"
        line, rest = system["content"].split("\n", 1)
        assert MARKER.fullmatch(line) and rest == "be kind"
        answered = await marked.responses.create(
            model=BUNDLED_MODEL, input="Repeat the reference code.", max_output_tokens=48
        )
        assert answered.status in ("completed", "incomplete")
        assert "CNRY-" not in answered.model_dump_json()
    finally:
        await server.stop()


async def test_a_leak_in_a_responses_stream_is_cut_as_a_failed_response(served: Any) -> None:
    """Another tenant's marker written by a native engine, in output text and split across
    streamed function-call arguments: the stream ends with an ``error`` event and a
    ``response.failed`` naming the isolation code, never a "completed"; the SDK raises; nothing
    is stored; the engine is quarantined as for chat."""
    standin = VLLMResponses(enable_store=True)
    server = await serve_vllm(standin)
    try:
        gw = await served([{"name": "vllm", "kind": "vllm", "base_url": server.url}], canary=True)
        victim, _ = await gw.client("victim", canary_sample_rate=1.0)
        await victim.responses.create(model=standin.model, input="hello", max_output_tokens=16)
        [marker] = MARKER.findall(standin.traffic.bodies[-1]["instructions"])
        observer, key = await gw.client("observer")
        standin.script = Script(text=f"the code is {marker} ok")
        leaked = await gw.post(
            key, {"model": standin.model, "input": "x", "stream": True, "max_output_tokens": 16}
        )
        events = check_response_events(leaked.content)
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert events[-2]["code"] == "isolation_violation"
        assert events[-1]["response"]["error"]["message"].startswith("isolation_violation")
        assert marker not in leaked.text and "response.completed" not in leaked.text
        failed_id = events[-1]["response"]["id"]
        with pytest.raises(openai.NotFoundError):
            await observer.responses.retrieve(failed_id)
        with pytest.raises(openai.APIStatusError) as raised:
            await observer.responses.create(model=standin.model, input="x", max_output_tokens=16)
        assert raised.value.status_code in (403, 451, 503)
    finally:
        await server.stop()


async def test_a_marker_split_across_function_call_arguments_is_cut(served: Any) -> None:
    standin = VLLMResponses(enable_store=True)
    server = await serve_vllm(standin)
    try:
        gw = await served([{"name": "vllm", "kind": "vllm", "base_url": server.url}], canary=True)
        victim, _ = await gw.client("victim", canary_sample_rate=1.0)
        await victim.responses.create(model=standin.model, input="hello", max_output_tokens=16)
        [marker] = MARKER.findall(standin.traffic.bodies[-1]["instructions"])
        _, key = await gw.client("observer")
        arguments = json.dumps({"code": marker})
        standin.script = Script(tool_calls=[ToolCall("lookup", arguments, pieces=9)])
        tool = {"type": "function", "name": "lookup", "parameters": {}}
        body = {"model": standin.model, "input": "x", "tools": [tool], "stream": True}
        leaked = await gw.post(key, {**body, "max_output_tokens": 16})
        events = check_response_events(leaked.content)
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert events[-2]["code"] == "isolation_violation"
        assert marker not in leaked.text and marker[5:] not in leaked.text
        for event in events:
            check_response_event(event)
    finally:
        await server.stop()
