"""The context-length 400 in OpenAI's words (``gateway.errors.context_length_message``), and the
real libraries applications use raising their context-window errors for exactly that body:
litellm's ``ContextWindowExceededError`` (what its context-window fallbacks catch) and LangChain's
``ContextOverflowError``, for chat completions and the Responses API. The server here is a tiny
aiohttp app returning the gateway's 400 body; the end-to-end runs against the gateway itself come
with the Responses routes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from gateway.errors import ContextLengthExceeded, context_length_message

OPENAI_WORDS = (
    "This model's maximum context length is 4096 tokens. However, you requested 4162 tokens "
    "(162 in the messages, 4000 in the completion). Please reduce the length of the messages or "
    "completion."
)


def test_the_message_begins_with_openais_words_and_names_the_parameter() -> None:
    message = context_length_message(
        limit=4096,
        prompt_tokens=162,
        completion_tokens=4000,
        completion_param="max_completion_tokens",
        reason="The limit is your plan's context limit.",
    )
    assert message == (
        OPENAI_WORDS + " The completion is the request's max_completion_tokens."
        " The limit is your plan's context limit. (context_length_exceeded)"
    )
    default = context_length_message(limit=4096, prompt_tokens=162, completion_tokens=4000)
    assert default.startswith(OPENAI_WORDS)
    assert default.endswith(
        "the gateway's default max_tokens (the request set none). (context_length_exceeded)"
    )
    max_tokens = context_length_message(
        limit=10, prompt_tokens=4, completion_tokens=9, completion_param="max_tokens"
    )
    assert "(4 in the messages, 9 in the completion)" in max_tokens
    assert max_tokens.endswith(
        "The completion is the request's max_tokens. (context_length_exceeded)"
    )


def test_a_prompt_alone_over_the_limit_and_other_inputs() -> None:
    assert context_length_message(limit=100, prompt_tokens=150, completion_tokens=None) == (
        "This model's maximum context length is 100 tokens. However, your messages resulted in "
        "150 tokens. Please reduce the length of the messages. (context_length_exceeded)"
    )
    responses = context_length_message(
        limit=100,
        prompt_tokens=90,
        completion_tokens=20,
        prompt_name="input",
        completion_param="max_output_tokens",
    )
    assert "(90 in the input, 20 in the completion)" in responses
    assert responses.endswith("the request's max_output_tokens. (context_length_exceeded)")


BODY = ContextLengthExceeded(
    context_length_message(
        limit=4096, prompt_tokens=162, completion_tokens=4000, completion_param="max_tokens"
    ),
    param="messages",
).body()


@pytest.fixture
async def gateway_400() -> AsyncIterator[str]:
    """An OpenAI-style server answering every chat and Responses request with the 400."""

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response(BODY, status=400)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", refuse)
    app.router.add_post("/v1/responses", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}/v1"
    await runner.cleanup()


def test_the_body_is_openais_shape() -> None:
    error = BODY["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error",
        "messages",
        "context_length_exceeded",
    )
    assert error["message"].startswith(OPENAI_WORDS)


async def test_litellm_raises_its_context_window_error(gateway_400: str) -> None:
    import litellm

    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(litellm.ContextWindowExceededError):
        await litellm.acompletion(
            model="openai/kvguard-tiny",
            api_base=gateway_400,
            api_key="sk-test",
            messages=messages,
            num_retries=0,
        )
    with pytest.raises(litellm.ContextWindowExceededError):
        await litellm.aresponses(
            model="openai/kvguard-tiny", api_base=gateway_400, api_key="sk-test", input="hi"
        )


@pytest.mark.parametrize("responses_api", [False, True])
async def test_langchain_raises_its_context_overflow_error(gateway_400: str, responses_api) -> None:
    from langchain_core.exceptions import ContextOverflowError
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        model="kvguard-tiny",
        base_url=gateway_400,
        api_key="sk-test",
        max_retries=0,
        use_responses_api=responses_api,
    )
    with pytest.raises(ContextOverflowError):
        await model.ainvoke("hi")
