"""Bugs the fuzzers found, pinned, and the engine's answer to a bug of its own.

Attackers: an admin (or a script holding the admin token) that asks for a key lifetime past what
a datetime can hold (``MAX_KEY_LIFETIME_S`` + 1, 10**12 and 2**63 seconds): now + lifetime
overflowed and the route answered 500; and anyone who makes an engine fail inside a route, then
reads the error for internals (Starlette's default answer was a plain-text 500 with no OpenAI
shape).

And a tenant whose assistant message carries a ``function_call``, or whose tools or tool calls are
not OpenAI's shape: a 400 naming it, not a 502 blaming the engine.

Proves: against the gateway as ``kvguard gateway`` serves it (uvicorn on 127.0.0.1, SQLite, the
real engine behind it), such a lifetime is a 400 naming the field on both routes that take one
(``key_expires_in_s`` when a tenant is created, ``expires_in_s`` for a new key), and the longest
allowed lifetime still gives a key that authenticates; and an unhandled error in the engine's app
(in-process: a route that raises stands in for any engine bug) is an OpenAI-style 500
``internal_error`` of type ``server_error`` that does not carry the exception's text.
"""

from __future__ import annotations

import httpx
import pytest
from hostile_harness import ENGINE_MODEL, ServedGateway, openai_error

from gateway.api.schemas_admin import MAX_KEY_LIFETIME_S


@pytest.mark.parametrize("lifetime", [MAX_KEY_LIFETIME_S + 1, 10**12, 2**63])
def test_a_key_lifetime_past_year_9999_is_400_not_500(
    gateway: ServedGateway, lifetime: int
) -> None:
    """now + timedelta(seconds=lifetime) overflowed datetime: OverflowError, a 500."""
    r = httpx.post(
        gateway.url + "/admin/tenants",
        json={"name": "long-lived", "key_expires_in_s": lifetime},
        headers=gateway.admin,
    )
    assert r.status_code == 400, r.text
    assert openai_error(r)["param"] == "key_expires_in_s"
    tenant, _ = gateway.create_tenant("acme")
    r = httpx.post(
        f"{gateway.url}/admin/tenants/{tenant}/keys",
        json={"expires_in_s": lifetime},
        headers=gateway.admin,
    )
    assert r.status_code == 400, r.text
    assert openai_error(r)["param"] == "expires_in_s"


def test_the_longest_allowed_key_lifetime_works(gateway: ServedGateway) -> None:
    tenant, _ = gateway.create_tenant("acme")
    r = httpx.post(
        f"{gateway.url}/admin/tenants/{tenant}/keys",
        json={"expires_in_s": MAX_KEY_LIFETIME_S},
        headers=gateway.admin,
    )
    assert r.status_code == 201, r.text
    key = r.json()["key"]
    r = httpx.get(gateway.url + "/v1/usage", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "function_call",
    [
        {},
        {"name": "f"},
        {"arguments": "{}"},
        {"name": "f", "arguments": "{}", "extra": 1},
        {"name": "", "arguments": ""},  # complete: the bundled engine takes no function_call
        {"name": "f", "arguments": "{}"},
    ],
)
def test_an_incomplete_function_call_is_400_naming_it(
    gateway: ServedGateway, function_call: dict[str, object]
) -> None:
    """The fuzzer's find: an assistant message's ``function_call`` (OpenAI's deprecated function
    calling; incomplete, or complete: the bundled engine's schema has no such field) passed the
    door and the engine's tokenizer refused it: 502 ``token_count_unavailable``, as if the engine
    had failed. Now: a 400 naming it (its field when incomplete; ``unsupported_parameter`` for the
    bundled engine when complete)."""
    _, key = gateway.create_tenant("caller")
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "function_call": function_call},
        {"role": "user", "content": "go on"},
    ]
    r = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": ENGINE_MODEL, "messages": messages, "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert r.status_code == 400, r.text
    error = openai_error(r)
    assert error["code"] != "token_count_unavailable"
    assert "function_call" in f"{error['param']} {error['message']}", error


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("tools", "tool_calls", "names"),
    [
        ([{"type": "function"}], None, "tools"),
        ([{"function": {"name": "f"}}], None, "tools"),  # no type: OpenAI requires it
        ([{"type": "function", "function": {"name": 5}}], None, "tools"),
        ([{"type": "function", "function": {"name": "a b"}}], None, "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "tools"),
        ([{"type": "function", "function": {"name": "f"}, "extra": 1}], None, "tools"),
        ([{"type": "custom", "custom": {"name": "c"}}], None, "function tools only"),
        ([TOOL], [{"id": "c1"}], "messages.1.tool_calls"),
        ([TOOL], [{"id": "c1", "type": "function", "function": {"name": "f"}}], "tool_calls"),
        ([TOOL], [{**CALL, "type": "custom"}], "function tools only"),
    ],
)
def test_a_malformed_tool_or_tool_call_is_400_naming_it(
    gateway: ServedGateway,
    tools: list[object],
    tool_calls: list[object] | None,
    names: str,
) -> None:
    """A smoke run's find: a tool or an assistant's tool call that is not OpenAI's shape passed
    the door (``tools`` and ``tool_calls`` were only lists of objects) and the engine's
    tokenizer refused it: 502 ``token_count_unavailable``, as if the engine had failed. Now: a
    400 naming it. Other tools than functions are refused by name, as the Responses route does."""
    _, key = gateway.create_tenant("caller")
    assistant = {"role": "assistant", "content": None, "tool_calls": tool_calls or [CALL]}
    messages = [
        {"role": "user", "content": "hi"},
        *(
            [assistant, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
            if tool_calls
            else []
        ),
        {"role": "user", "content": "go on"},
    ]
    r = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": ENGINE_MODEL, "messages": messages, "tools": tools, "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert r.status_code == 400, r.text
    error = openai_error(r)
    assert error["code"] == "invalid_request"
    assert names in f"{error['param']} {error['message']}", error


def test_a_well_formed_tool_conversation_is_served(gateway: ServedGateway) -> None:
    _, key = gateway.create_tenant("caller")
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "user", "content": "go on"},
    ]
    r = httpx.post(
        gateway.url + "/v1/chat/completions",
        json={"model": ENGINE_MODEL, "messages": messages, "tools": [TOOL], "max_tokens": 2},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert r.status_code == 200, r.text


async def test_an_engine_bug_is_an_openai_style_500_without_internals(tiny_checkpoint: str) -> None:
    """Starlette's default answer to an unhandled error is a plain-text 500: not the error shape
    clients (and the gateway) parse. A route that raises stands in for any engine bug."""
    from backend.config import BackendSettings
    from backend.server.app import create_app

    app = create_app(BackendSettings(model=tiny_checkpoint, pool_tokens=256))

    def boom() -> None:
        raise RuntimeError("secret internal detail")

    app.add_api_route("/boom", boom)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as client:
        r = await client.get("/boom")
    assert r.status_code == 500
    error = openai_error(r)
    assert (error["code"], error["type"]) == ("internal_error", "server_error")
    assert "secret" not in r.text
