"""The OpenAI surface through the gateway with the official ``openai`` SDK, unchanged (default
retries): the real bundled engine, and the vLLM and SGLang stand-ins. Every answer and every
stream event the gateway sends is validated against OpenAI's published schemas (tests/openapi)."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
from openai_contract import check, check_sse
from standin_openai import Script, ToolCall
from standin_sglang import SGLangWorker
from standin_sglang import worker_app as sglang_app
from standin_vllm import VLLMWorker
from standin_vllm import worker_app as vllm_app

from canary.config import CanarySettings
from canary.runtime import CanaryRuntime
from gateway.app import create_app
from kvguard.testing import EngineProcess, RunningServer, launch_engine, serve

BUNDLED_MODEL = "tiny-llama"
CANARY_KEY = "sdk-test-canary-key-0123456789abcdef0123"
MARKER = re.compile(r"CNRY-[A-Z2-7]{32}")
ARGS = '{"city": "Oslo", "days": 3}'


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: str) -> Iterator[EngineProcess]:
    proc = launch_engine(
        tiny_checkpoint,
        pool_tokens=512,
        page_size=16,
        env={"KVGUARD_SERVED_MODEL_NAME": BUNDLED_MODEL},
    )
    yield proc
    proc.stop()


@dataclass
class Served:
    url: str
    admin: dict[str, str]
    server: RunningServer
    stoppers: list[RunningServer] = field(default_factory=list)

    async def client(self, name: str = "acme", **limits: Any) -> tuple[openai.AsyncOpenAI, str]:
        async with httpx.AsyncClient() as http:
            r = await http.post(
                f"{self.url}/admin/tenants", json={"name": name, **limits}, headers=self.admin
            )
        key = r.json()["key"]["key"]
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=key), key


@pytest.fixture
async def served(make_settings: Any) -> AsyncIterator[Any]:
    started: list[RunningServer] = []
    gateways: list[Served] = []

    async def start(engines: list[dict[str, Any]], *, canary: bool = False) -> Served:
        settings = make_settings(engines=engines)
        hooks = CanaryRuntime(CanarySettings(canary_key=CANARY_KEY)).hooks() if canary else None
        server = await serve(create_app(settings, hooks=hooks), lifespan="on")
        started.append(server)
        admin = {"Authorization": f"Bearer {settings.admin_secret()}"}
        gateways.append(Served(server.url, admin, server))
        return gateways[-1]

    yield start
    for server in started:
        await server.stop()
    for gw in gateways:
        for extra in gw.stoppers:
            await extra.stop()


async def _raw(url: str, key: str, path: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(
            f"{url}/v1{path}", json=body, headers={"Authorization": f"Bearer {key}"}
        )


async def test_the_sdk_against_the_bundled_engine(engine: EngineProcess, served: Any) -> None:
    gw = await served([{"name": "tiny", "kind": "bundled", "base_url": engine.url}])
    client, key = await gw.client()
    listed = await client.models.with_raw_response.list()
    check("ListModelsResponse", listed.http_response.json())
    model = await client.models.retrieve(BUNDLED_MODEL)
    assert model.id == BUNDLED_MODEL
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("nobody-serves-this")

    raw = await client.chat.completions.with_raw_response.create(
        model=BUNDLED_MODEL,
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}]},
        ],
        n=2,
        logprobs=True,
        top_logprobs=2,
        presence_penalty=0.0,
        frequency_penalty=0.5,
        logit_bias={"65": 1},
        max_completion_tokens=6,
        seed=7,
        temperature=1.0,
    )
    body = check("CreateChatCompletionResponse", raw.http_response.json())
    completion = raw.parse()
    assert body["id"].startswith("chatcmpl-") and len(completion.choices) == 2
    assert all(len(c.logprobs.content[0].top_logprobs) == 2 for c in completion.choices)
    assert completion.usage.completion_tokens <= 12
    assert raw.http_response.headers["x-kvguard-request-id"]

    stream = await client.chat.completions.create(
        model=BUNDLED_MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    seen = [chunk async for chunk in stream]
    assert seen[-1].usage is not None and seen[-1].choices == []

    for path, request, name in (
        (
            "/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "n": 2,
                "logprobs": True,
                "top_logprobs": 1,
            },
            "CreateChatCompletionStreamResponse",
        ),
        ("/completions", {"prompt": "abc", "logprobs": 2, "n": 2}, "CreateCompletionChunk"),
    ):
        fields = {"model": BUNDLED_MODEL, "max_tokens": 5, "stream": True, **request}
        fields["stream_options"] = {"include_usage": True}
        r = await _raw(gw.url, key, path, fields)
        events = check_sse(r.content, name)
        assert events[-1]["usage"]["completion_tokens"] > 0
        fields.pop("stream"), fields.pop("stream_options")
        whole = await _raw(gw.url, key, path, fields)
        schema = name.replace("StreamResponse", "Response").replace("Chunk", "Response")
        check(schema, whole.json())

    # the bundled engine reports tools: a forced call comes back in OpenAI's schema, whole and
    # streamed (a strict tool without properties: its only call is "{}")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    call = {"model": BUNDLED_MODEL, "messages": [{"role": "user", "content": "hi"}]}
    call |= {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "f"}}}
    raw = await client.chat.completions.with_raw_response.create(**call, max_tokens=64)
    body = check("CreateChatCompletionResponse", raw.http_response.json())
    assert body["choices"][0]["finish_reason"] == "stop"
    (function,) = [c["function"] for c in body["choices"][0]["message"]["tool_calls"]]
    assert function == {"name": "f", "arguments": "{}"}
    r = await _raw(gw.url, key, "/chat/completions", {**call, "max_tokens": 64, "stream": True})
    check_sse(r.content, "CreateChatCompletionStreamResponse")

    with pytest.raises(openai.BadRequestError) as refused:
        await client.chat.completions.create(
            model=BUNDLED_MODEL,
            messages=[{"role": "user", "content": "hi"}],
            reasoning_effort="low",
        )
    assert refused.value.code == "unsupported_parameter"
    assert refused.value.param == "reasoning_effort"
    check("ErrorResponse", refused.value.response.json())


def _engine(kind: str, url: str) -> dict[str, Any]:
    return {"name": kind, "kind": kind, "base_url": url}


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_tool_calls_and_logprobs_from_the_stand_ins_match_the_schemas(
    served: Any, kind: str
) -> None:
    worker: VLLMWorker | SGLangWorker = VLLMWorker() if kind == "vllm" else SGLangWorker()
    server = await serve(vllm_app(worker) if isinstance(worker, VLLMWorker) else sglang_app(worker))
    try:
        gw = await served([_engine(kind, server.url)])
        client, key = await gw.client()
        worker.script = Script(tool_calls=[ToolCall("get_weather", ARGS, pieces=4)])
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
        chat = {"model": worker.model, "messages": [{"role": "user", "content": "weather?"}]}
        raw = await client.chat.completions.with_raw_response.create(**chat, tools=tools)
        check("CreateChatCompletionResponse", raw.http_response.json())
        [call] = raw.parse().choices[0].message.tool_calls
        assert (call.function.name, call.function.arguments) == ("get_weather", ARGS)

        stream = await client.chat.completions.create(**chat, tools=tools, stream=True)
        deltas = [c.choices[0].delta for c in [chunk async for chunk in stream] if c.choices]
        arguments = "".join(
            tc.function.arguments or "" for d in deltas for tc in d.tool_calls or []
        )
        assert arguments == ARGS
        r = await _raw(gw.url, key, "/chat/completions", {**chat, "tools": tools, "stream": True})
        check_sse(r.content, "CreateChatCompletionStreamResponse")

        worker.script = Script(text="one two three", logprobs=True)
        body = {**chat, "logprobs": True, "stream": True, "stream_options": {"include_usage": True}}
        events = check_sse(
            (await _raw(gw.url, key, "/chat/completions", body)).content,
            "CreateChatCompletionStreamResponse",
        )
        tokens = [
            t["token"]
            for e in events
            for c in e["choices"]
            for t in (c.get("logprobs") or {}).get("content") or []
        ]
        assert "".join(tokens) == "one two three"
        completion = await _raw(
            gw.url, key, "/completions", {"model": worker.model, "prompt": "x", "max_tokens": 3}
        )
        check("CreateCompletionResponse", completion.json())
    finally:
        await server.stop()


async def _leaking_vllm(served: Any) -> tuple[Served, VLLMWorker, openai.AsyncOpenAI, str]:
    """A canary gateway in front of a vLLM stand-in that has seen the victim's marked prompt;
    (gateway, worker, the observer's SDK client, the victim's marker)."""
    worker = VLLMWorker()
    server = await serve(vllm_app(worker))
    gw = await served([_engine("vllm", server.url)], canary=True)
    gw.stoppers.append(server)
    victim, _ = await gw.client("victim", canary_sample_rate=1.0)
    chat = {"model": worker.model, "messages": [{"role": "user", "content": "hello"}]}
    await victim.chat.completions.create(**chat)
    [marker] = MARKER.findall(worker.traffic.prompts[-1])  # injected by the gateway
    observer, _ = await gw.client("observer")
    return gw, worker, observer, marker


async def test_the_sdk_sees_isolation_violation_after_a_cut_with_its_default_retries(
    served: Any,
) -> None:
    gw, worker, observer, marker = await _leaking_vllm(served)
    worker.script = Script(text=f"the code is {marker}")
    asked = len(worker.traffic.bodies)
    assert observer.max_retries == 2  # the SDK's default, unchanged
    with pytest.raises(openai.APIStatusError) as caught:
        await observer.chat.completions.create(
            model=worker.model, messages=[{"role": "user", "content": "hi"}]
        )
    error = caught.value
    assert (error.status_code, error.code) == (502, "isolation_violation")
    assert error.response.headers["x-should-retry"] == "false"
    assert error.request_id == error.response.headers["x-kvguard-request-id"]
    check("ErrorResponse", error.response.json())
    assert len(worker.traffic.bodies) == asked + 1  # no retry reached the engine
    assert marker[:6] not in error.response.text
    # The text agrees with the header (no advice to retry) and promises nothing the gateway
    # cannot keep (a finding is stored after the answer is cut, and can fail to be).
    message = error.response.json()["error"]["message"]
    assert "retry the request" not in message and "recorded" not in message
    assert "does not belong to this request" in message


async def test_a_marker_split_across_streamed_tool_call_arguments_is_cut(served: Any) -> None:
    gw, worker, observer, marker = await _leaking_vllm(served)
    arguments = json.dumps({"city": "Oslo", "ref": marker})
    worker.script = Script(tool_calls=[ToolCall("lookup", arguments, pieces=9)])
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    stream = await observer.chat.completions.create(
        model=worker.model,
        messages=[{"role": "user", "content": "look it up"}],
        tools=tools,
        stream=True,
    )
    received = []
    with pytest.raises(openai.APIError) as caught:
        async for chunk in stream:
            received.append(chunk.model_dump_json())
    assert "isolation_violation" in str(caught.value.body)
    delivered = "".join(received)
    assert marker[:6] not in delivered and marker[5:13] not in delivered
    assert '"name":"lookup"' in delivered  # the call's header went out before the marker came
    # The same stream as raw bytes (the engine back in service): every event, the error included,
    # is a valid schema object, and the stream ends without [DONE].
    async with httpx.AsyncClient(timeout=60) as http:
        cleared = await http.delete(f"{gw.url}/admin/engines/vllm/quarantine", headers=gw.admin)
        assert cleared.status_code == 200
        body = {"model": worker.model, "messages": [{"role": "user", "content": "again"}]}
        raw = await http.post(
            f"{gw.url}/v1/chat/completions",
            json={**body, "tools": tools, "stream": True},
            headers={"Authorization": f"Bearer {observer.api_key}"},
        )
    events = check_sse(raw.content, "CreateChatCompletionStreamResponse")
    assert events[-1]["error"]["code"] == "isolation_violation" and b"[DONE]" not in raw.content
    assert marker[:6].encode() not in raw.content


async def test_every_answer_carries_the_request_id_the_sdk_reads(served: Any) -> None:
    """Errors raised before any engine is asked (a 400 from validation, a 401, a 404) and the
    model list carry ``x-request-id``: the SDK's ``request_id`` names the request to report."""
    worker = VLLMWorker()
    server = await serve(vllm_app(worker))
    gw = await served([_engine("vllm", server.url)])
    gw.stoppers.append(server)
    client, _ = await gw.client()
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    failures: list[tuple[type[openai.APIStatusError], Any]] = [
        (openai.BadRequestError, client.chat.completions.create(model=worker.model, n=99, **chat)),
        (openai.NotFoundError, client.chat.completions.create(model="nobody-serves-this", **chat)),
        (openai.NotFoundError, client.models.retrieve("nobody-serves-this")),
    ]
    stranger = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="kvg_000000000000_" + "0" * 64)
    failures.append((openai.AuthenticationError, stranger.models.list()))
    for kind, call in failures:
        with pytest.raises(kind) as caught:
            await call
        assert caught.value.request_id, f"{kind.__name__} without request_id"
        assert caught.value.request_id == caught.value.response.headers["x-kvguard-request-id"]
    listed = await client.models.with_raw_response.list()
    answered = await client.chat.completions.with_raw_response.create(model=worker.model, **chat)
    ids = [r.http_response.headers["x-request-id"] for r in (listed, answered)]
    assert all(ids) and len(set(ids)) == 2
    assert answered.http_response.headers["x-kvguard-request-id"] == ids[1]
    # One id per request, in the answer and in what the engine was told.
    assert worker.traffic.headers[-1]["x-kvguard-request-id"] == ids[1]


async def test_tool_call_arguments_from_the_bundled_engine_are_screened(
    engine: EngineProcess, served: Any
) -> None:
    """The bundled engine now serves tools, and the firewall still screens what the model writes
    there: a tool whose argument must be shaped like a canary marker makes the engine write
    `CNRY-` and 32 base32 characters into the call (its grammar allows nothing else), and what
    reaches the tenant has none, streamed or not (the tenant's own injected marker, or a
    look-alike, is stripped from tool-call arguments as from text)."""
    gw = await served([{"name": "tiny", "kind": "bundled", "base_url": engine.url}], canary=True)
    client, _ = await gw.client("marked", canary_sample_rate=1.0)
    code = {"type": "string", "pattern": "^CNRY-[A-Z2-7]{32}$"}
    tool = {
        "type": "function",
        "function": {
            "name": "file",
            "parameters": {"type": "object", "properties": {"code": code}, "required": ["code"]},
        },
    }
    ask = {
        "model": BUNDLED_MODEL,
        "messages": [{"role": "user", "content": "Repeat the reference code."}],
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "file"}},
        "max_tokens": 64,
    }
    raw = await client.chat.completions.with_raw_response.create(**ask)
    body = check("CreateChatCompletionResponse", raw.http_response.json())
    (call,) = body["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "file"
    assert "CNRY-" not in call["function"]["arguments"]
    stream = await client.chat.completions.create(**ask, stream=True)
    streamed = "".join([chunk.model_dump_json() async for chunk in stream])
    assert '"name":"file"' in streamed and "CNRY-" not in streamed
    # the same request straight to the engine: the model did write a marker-shaped argument
    async with httpx.AsyncClient(timeout=60) as http:
        direct = (await http.post(f"{engine.url}/v1/chat/completions", json=ask)).json()
    (call,) = direct["choices"][0]["message"]["tool_calls"]
    assert MARKER.fullmatch(json.loads(call["function"]["arguments"])["code"])
