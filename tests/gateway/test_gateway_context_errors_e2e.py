"""The context-length 400 of the real gateway in front of the REAL bundled engine, read by the
real libraries applications use: litellm (``acompletion``, ``atext_completion``) raises its
``ContextWindowExceededError`` (what its context-window fallbacks catch;
``litellm_core_utils/exception_mapping_utils.py``), LangChain's ``ChatOpenAI`` its
``ContextOverflowError`` (``langchain_openai/chat_models/base.py``). The message names the
parameter the client sent (``max_tokens``, ``max_completion_tokens``; a Responses request's
``input`` and ``max_output_tokens``) or says the gateway's default set the completion's size. One
engine and one gateway for the module."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from gateway_harness import Gateway, bearer, running_gateway

pytestmark = pytest.mark.slow

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
os.environ.setdefault("LITELLM_OFFLINE_MODE", "true")

WINDOW = 128
LONG = "a" * 100  # the byte tokenizer: 100 tokens and the chat frame, well within the window
TOO_LONG = "a" * 400  # over the window by itself


@pytest.fixture
async def served(engine_factory: Any, make_settings: Any) -> AsyncIterator[tuple[Gateway, str]]:
    engine = await anyio.to_thread.run_sync(
        lambda: engine_factory(pool_tokens=WINDOW, page_size=16, context_window=WINDOW)
    )
    async with running_gateway(make_settings(engines=[{"name": "real", "base_url": engine}])) as gw:
        _, key = await gw.create_tenant("acme")
        yield gw, key


async def _model(gw: Gateway, key: str) -> str:
    models = (await gw.client.get("/v1/models", headers=bearer(key))).json()["data"]
    return str(models[0]["id"])


async def test_the_400_names_the_parameter_the_client_sent(served: tuple[Gateway, str]) -> None:
    gw, key = served
    model = await _model(gw, key)
    user = [{"role": "user", "content": LONG}]

    async def error(path: str, body: dict[str, Any]) -> dict[str, Any]:
        r = await gw.client.post(path, json={"model": model, **body}, headers=bearer(key))
        assert r.status_code == 400, r.text
        return dict(r.json()["error"])

    chat = "/v1/chat/completions"
    by_max_tokens = await error(chat, {"messages": user, "max_tokens": 100})
    by_completion = await error(chat, {"messages": user, "max_completion_tokens": 100})
    by_prompt = await error("/v1/completions", {"prompt": LONG, "max_tokens": 100})
    alone = await error(chat, {"messages": [{"role": "user", "content": TOO_LONG}]})
    # the Responses API, translated into a chat completion for this engine: its own names
    by_output = await error("/v1/responses", {"input": LONG, "max_output_tokens": 100})
    input_alone = await error("/v1/responses", {"input": TOO_LONG})
    for found in (by_max_tokens, by_completion, by_prompt, alone, by_output, input_alone):
        assert found["code"] == "context_length_exceeded"
        assert found["message"].startswith(f"This model's maximum context length is {WINDOW} ")
        assert found["message"].endswith("(context_length_exceeded)")
    assert "The completion is the request's max_tokens." in by_max_tokens["message"]
    assert "The completion is the request's max_completion_tokens." in by_completion["message"]
    assert (by_max_tokens["param"], by_completion["param"]) == ("messages", "messages")
    assert "in the prompt, 100 in the completion" in by_prompt["message"]
    assert "The completion is the request's max_tokens." in by_prompt["message"]
    assert by_prompt["param"] == "prompt"
    assert "However, your messages resulted in" in alone["message"]
    assert "The completion is the request's max_output_tokens." in by_output["message"]
    assert (by_output["param"], input_alone["param"]) == ("input", "input")
    assert "However, your input resulted in" in input_alone["message"]


async def test_litellm_and_langchain_raise_their_context_window_errors(
    served: tuple[Gateway, str],
) -> None:
    import litellm
    from langchain_core.exceptions import ContextOverflowError
    from langchain_openai import ChatOpenAI

    gw, key = served
    model = await _model(gw, key)
    base = f"{gw.client.base_url}".rstrip("/") + "/v1"
    user = [{"role": "user", "content": LONG}]
    common = {"model": f"openai/{model}", "api_base": base, "api_key": key, "num_retries": 0}
    with pytest.raises(litellm.ContextWindowExceededError):
        await litellm.acompletion(messages=user, max_tokens=100, **common)
    with pytest.raises(litellm.ContextWindowExceededError):
        await litellm.acompletion(messages=user, max_completion_tokens=100, **common)
    with pytest.raises(litellm.ContextWindowExceededError):
        await litellm.acompletion(messages=user, max_tokens=100, stream=True, **common)
    with pytest.raises(litellm.ContextWindowExceededError):
        await litellm.atext_completion(prompt=LONG, max_tokens=100, **common)
    # the success path through the same client still works (the 400 is the size, nothing else)
    answer = await litellm.acompletion(messages=[{"role": "user", "content": "hi"}], **common)
    assert answer.choices[0].message.content is not None

    chat = ChatOpenAI(model=model, base_url=base, api_key=key, max_retries=0, max_tokens=100)
    with pytest.raises(ContextOverflowError):
        await chat.ainvoke(LONG)
    streaming = ChatOpenAI(model=model, base_url=base, api_key=key, max_retries=0, streaming=True)
    with pytest.raises(ContextOverflowError):
        await streaming.ainvoke(TOO_LONG)
    responses = ChatOpenAI(
        model=model, base_url=base, api_key=key, max_retries=0, use_responses_api=True
    )
    with pytest.raises(ContextOverflowError):
        await responses.ainvoke(TOO_LONG)
