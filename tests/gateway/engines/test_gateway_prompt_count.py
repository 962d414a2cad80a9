"""Admission counts the prompt an engine really renders: a chat's tool definitions (and what else
the engine's chat template renders from the request) count like its messages, on vLLM and SGLang.

The stand-ins render tools into the prompt the way the real servers' chat templates do
(``standin_openai.tools_turn``) in their chat routes and in their tokenize routes given the same
fields, so a count that leaves them out admits a request the engine then refuses."""

from __future__ import annotations

from typing import Any

import pytest
from gateway_harness import bearer, running_gateway
from standin_openai import MESSAGE_OVERHEAD, NO_THINKING, tools_turn
from standin_sglang import SGLangWorker
from standin_sglang import worker_app as sglang_app
from standin_vllm import VLLMWorker
from standin_vllm import worker_app as vllm_app

from gateway.engines import prompt
from gateway.openai import surface
from kvguard.testing import serve

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "what is the weather"}]  # 4 words
MESSAGES_TOKENS = 4 + MESSAGE_OVERHEAD


def _tool(name: str, description_words: int) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": " ".join(["word"] * description_words),
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }


def _tools_tokens(tools: list[dict[str, Any]]) -> int:
    return len(tools_turn(tools).split()) + MESSAGE_OVERHEAD


async def _serve(kind: str) -> tuple[Any, VLLMWorker | SGLangWorker]:
    worker: VLLMWorker | SGLangWorker = VLLMWorker() if kind == "vllm" else SGLangWorker()
    app = vllm_app(worker) if isinstance(worker, VLLMWorker) else sglang_app(worker)
    return await serve(app), worker


def _window(worker: VLLMWorker | SGLangWorker) -> int:
    """The limit a request must fit: vLLM's max_model_len; SGLang's context or smallest pool."""
    if isinstance(worker, VLLMWorker):
        return worker.max_model_len
    return min(worker.context_len, *worker.rank_pools)


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
async def test_tool_definitions_count_in_the_prompt(make_settings: Any, kind: str) -> None:
    server, worker = await _serve(kind)
    window = _window(worker)
    try:
        settings = make_settings(engines=[{"name": kind, "kind": kind, "base_url": server.url}])
        async with running_gateway(settings) as gw:
            _, key = await gw.create_tenant("acme")
            chat = {"model": worker.model, "messages": MESSAGES}

            # Tools that fit: the engine gets as much max_tokens as fits after the real prompt.
            tools = [_tool("get_weather", 300), _tool("get_time", 200)]
            r = await gw.client.post(CHAT, json={**chat, "tools": tools}, headers=bearer(key))
            assert r.status_code == 200, r.text
            prompt = MESSAGES_TOKENS + _tools_tokens(tools)
            assert r.json()["usage"]["prompt_tokens"] == prompt
            assert worker.traffic.bodies[-1]["max_tokens"] == window - prompt

            # Tools too large for the window: refused at the door, the engine never asked.
            huge = [_tool("get_weather", window)]
            asked = len(worker.traffic.bodies)
            r = await gw.client.post(CHAT, json={**chat, "tools": huge}, headers=bearer(key))
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "context_length_exceeded"
            counted = MESSAGES_TOKENS + _tools_tokens(huge)
            assert f"However, your messages resulted in {counted} tokens." in r.text
            assert len(worker.traffic.bodies) == asked
    finally:
        await server.stop()


async def test_what_only_sglang_leaves_out_or_only_vllm_adds(make_settings: Any) -> None:
    """SGLang renders no tools for tool_choice "none" and only the named one for a named choice;
    vLLM turns reasoning_effort "none" into the template's thinking switch (a Qwen3-style
    template then writes an empty thinking block)."""
    tools = [_tool("get_weather", 300), _tool("get_time", 200)]
    cases = [
        ("sglang", {"tools": tools, "tool_choice": "none"}, MESSAGES_TOKENS),
        (
            "sglang",
            {"tools": tools, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            MESSAGES_TOKENS + _tools_tokens(tools[1:]),
        ),
        (
            "vllm",
            {"tools": tools, "tool_choice": "none"},
            MESSAGES_TOKENS + _tools_tokens(tools),
        ),
        ("vllm", {"reasoning_effort": "none"}, MESSAGES_TOKENS + len(NO_THINKING.split())),
        ("vllm", {"reasoning_effort": "high"}, MESSAGES_TOKENS),
    ]
    for case, (kind, fields, prompt_tokens) in enumerate(cases):
        server, worker = await _serve(kind)
        try:
            settings = make_settings(engines=[{"name": kind, "kind": kind, "base_url": server.url}])
            async with running_gateway(settings) as gw:
                _, key = await gw.create_tenant(f"tenant-{case}")
                body = {"model": worker.model, "messages": MESSAGES, **fields}
                r = await gw.client.post(CHAT, json=body, headers=bearer(key))
                assert r.status_code == 200, (kind, fields, r.text)
                assert r.json()["usage"]["prompt_tokens"] == prompt_tokens, (kind, fields)
                assert worker.traffic.bodies[-1]["max_tokens"] == _window(worker) - prompt_tokens
        finally:
            await server.stop()


async def test_sglang_before_0_5_12_refuses_chats_naming_the_version(
    make_settings: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang before 0.5.12 counts prompt strings only (its TokenizeRequest has no messages): the
    engine is probed with a prompt and stays routable for completions, and a chat fails closed
    (502 token_count_unavailable) for the reason the log names, never admitted on a guess."""
    worker = SGLangWorker(legacy=True, version="0.5.5")
    server = await serve(sglang_app(worker))
    try:
        settings = make_settings(
            engines=[{"name": "old", "kind": "sglang", "base_url": server.url}]
        )
        async with running_gateway(settings) as gw:
            _, key = await gw.create_tenant("acme")
            assert worker.traffic.tokenize_bodies[0] == {"model": worker.model, "prompt": "kvguard"}
            r = await gw.client.post(
                "/v1/completions",
                json={"model": worker.model, "prompt": "a b c", "max_tokens": 4},
                headers=bearer(key),
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] == 3
            asked = len(worker.traffic.bodies)
            chat = {"model": worker.model, "messages": MESSAGES, "max_tokens": 4}
            with caplog.at_level("WARNING", logger="kvguard.gateway"):
                r = await gw.client.post(CHAT, json=chat, headers=bearer(key))
            assert r.status_code == 502, r.text
            assert r.json()["error"]["code"] == "token_count_unavailable"
            assert "token count on engine old failed: SGLang 0.5.5 counts prompt strings only" in (
                caplog.text
            )
            assert "from 0.5.12" in caplog.text
            assert len(worker.traffic.bodies) == asked  # the engine never got the chat
    finally:
        await server.stop()


def test_what_each_kind_is_sent_to_count() -> None:
    """The tokenize request per kind (gateway.engines.prompt), as vLLM 0.33.0 and SGLang 0.5.23
    read it: vLLM takes tools and chat_template_kwargs only (the template variables its chat
    route derives, the Kimi K3 renderer's included); SGLang renders the whole body as a chat."""
    schema = {"type": "object", "properties": {}}
    body = {
        "model": "m",
        "messages": MESSAGES,
        "tools": [_tool("get_time", 2)],
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "out", "description": None, "schema": schema, "strict": True},
        },
        "reasoning_effort": "low",
        "temperature": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert prompt.for_vllm("m", body) == {
        "model": "m",
        "messages": MESSAGES,
        "tools": body["tools"],
        "chat_template_kwargs": {
            "reasoning_effort": "low",
            "enable_thinking": True,
            "tool_choice": {"function": {"name": "get_time"}, "type": "function"},
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "out", "json_schema": schema, "strict": True},
            },
        },
    }
    assert prompt.for_vllm("m", {"messages": MESSAGES, "tool_choice": "required"}) == {
        "model": "m",
        "messages": MESSAGES,  # no tools: vLLM passes no tool_choice to the template
    }
    sent = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    assert prompt.for_sglang("m", body) == sent
    for kind in (prompt.for_vllm, prompt.for_sglang, prompt.plain):
        assert kind("m", {"prompt": "a b", "temperature": 1}) == {"model": "m", "prompt": "a b"}


def test_the_bundled_count_renders_what_its_template_renders() -> None:
    """The bundled engine's /tokenize is sent the messages and the tools (its chat template
    writes both); tool_choice and response_format constrain sampling and are not in the prompt;
    what another kind's template renders besides is refused for it at the door."""
    body = {
        "model": "m",
        "messages": MESSAGES,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "required",
        "response_format": {"type": "json_object"},
        "temperature": 0,
    }
    want = {"model": "m", "messages": MESSAGES, "tools": body["tools"]}
    assert prompt.for_bundled("m", body) == want
    assert prompt.for_bundled("m", {"prompt": "a b", "tools": []}) == {
        "model": "m",
        "prompt": "a b",
    }
    for profile in (surface.Profile.BUNDLED, surface.Profile.BUNDLED_PD):
        for field in ("reasoning_effort", "functions"):
            assert surface.RULES[field].decision(profile) is surface.Decision.REFUSE, field
        for field in ("tools", "tool_choice", "response_format"):
            assert surface.RULES[field].decision(profile) is surface.Decision.REPORTED, field
