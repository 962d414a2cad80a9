"""Bad input anywhere is a 4xx with an OpenAI-style body, never a 500 or a hang."""

from __future__ import annotations

import httpx
import pytest
from gateway_harness import bearer

from contracts.openai import MAX_PASSED_ON_VALUES

MODEL = "standin-model"
CHAT = "/v1/chat/completions"


def _ok_chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}


BAD_JSON_BODIES = [
    (CHAT, b"{not json", 400, "invalid_request"),
    (CHAT, b"", 400, "invalid_request"),
    (CHAT, b"[1, 2]", 400, "invalid_request"),
    (CHAT, b'"text"', 400, "invalid_request"),
    (CHAT, b"\xff\xfe\x00garbage", 400, "invalid_encoding"),
    (CHAT, b'{"model": "m\xc3\x28"}', 400, "invalid_encoding"),
    ("/v1/completions", b"null", 400, "invalid_request"),
    # valid JSON, but a lone UTF-16 surrogate is no text any engine can encode
    (
        CHAT,
        b'{"model":"m","messages":[{"role":"user","content":"a\\udc80"}]}',
        400,
        "invalid_request",
    ),
    ("/v1/completions", b'{"model":"m","prompt":"\\ud800"}', 400, "invalid_request"),
    ("/admin/tenants", b"{bad", 400, "invalid_request"),
]

BAD_FIELDS = [
    (_ok_chat(max_tokens="many"), "max_tokens"),
    (_ok_chat(max_tokens=0), "max_tokens"),
    (_ok_chat(max_tokens=1 << 21), "max_tokens"),
    (_ok_chat(max_tokens=1.5), "max_tokens"),
    (_ok_chat(temperature=3), "temperature"),
    (_ok_chat(temperature="hot"), "temperature"),
    (_ok_chat(stream="yes"), "stream"),
    (_ok_chat(n=17), "n"),
    (_ok_chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (_ok_chat(stop=[""]), "stop"),
    (_ok_chat(tools="x"), "tools"),
    (_ok_chat(top_logprobs=2), None),
    (_ok_chat(response_format={"schema": {}}), None),
    (_ok_chat(tool_choice="required"), None),
    (_ok_chat(tools=[], tool_choice={"type": "function", "function": {"name": "f"}}), None),
    (_ok_chat(stream_options={"include_usage": True}), None),
    (_ok_chat(max_tokens=5, max_completion_tokens=5), None),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"model": MODEL, "messages": "hi"}, "messages"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    (
        {"model": MODEL, "messages": [{"role": "user", "content": "x", "extra": 1}]},
        "messages.0.extra",
    ),
    ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": "", "messages": [{"role": "user", "content": "x"}]}, "model"),
    ({"model": 7, "messages": [{"role": "user", "content": "x"}]}, "model"),
]


async def test_malformed_bodies(gateway) -> None:
    _, key = await gateway.create_tenant("acme")
    headers = {**bearer(key), "content-type": "application/json"}
    admin = {**gateway.admin, "content-type": "application/json"}
    for path, raw, status, code in BAD_JSON_BODIES:
        r = await gateway.client.post(
            path, content=raw, headers=admin if path.startswith("/admin") else headers
        )
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), (path, raw)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(("body", "param"), BAD_FIELDS)
async def test_wrong_types_ranges_and_unknown_fields(gateway, body, param) -> None:
    _, key = await gateway.create_tenant("acme")
    r = await gateway.client.post(CHAT, json=body, headers=bearer(key))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["type"], error["param"]) == (
        "invalid_request",
        "invalid_request_error",
        param,
    )


async def test_huge_bodies_are_413(make_settings, standin) -> None:
    from gateway_harness import running_gateway

    settings = make_settings(max_body_bytes=2048, engines=[{"name": "s", "base_url": standin.url}])
    async with running_gateway(settings) as gw:
        _, key = await gw.create_tenant("acme")
        big = _ok_chat()
        big["messages"][0]["content"] = "x" * 4096
        r = await gw.client.post(CHAT, json=big, headers=bearer(key))
        assert (r.status_code, r.json()["error"]["code"]) == (413, "body_too_large")

        async def chunks():  # no content-length: streamed, cut off at the limit
            for _ in range(100):
                yield b"x" * 1000

        # in-process: over a socket the 413 and the close race the client's unsent 98 KB (a
        # reset); tests/hostile/test_hostile_edge.py reads that answer on a raw socket
        transport = httpx.ASGITransport(app=gw.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as local:
            r = await local.post(CHAT, content=chunks(), headers=bearer(key))
        assert (r.status_code, r.json()["error"]["code"]) == (413, "body_too_large")


async def test_unknown_routes_and_methods(gateway) -> None:
    r = await gateway.client.post("/v1/nothing/here", json={})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "unknown_url")
    message = r.json()["error"]["message"]
    assert message.startswith("Invalid URL (POST /v1/nothing/here): no such endpoint here. ")
    for served in (
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "POST /v1/embeddings",
        "POST /v1/responses",
        "GET /v1/responses/{response_id}",
        "DELETE /v1/responses/{response_id}",
        "GET /v1/responses/{response_id}/input_items",
        "POST /v1/responses/{response_id}/cancel",
        "GET /v1/models",
        "GET /v1/models/{model}",
    ):
        assert served in message, served
    assert r.json()["error"]["type"] == "invalid_request_error"
    for method, path in (("POST", CHAT + "/"), ("POST", "/v1/responses/"), ("GET", "/v1/x/y/")):
        r = await gateway.client.request(method, path, json={})  # OpenAI's answer: no redirect
        assert (r.status_code, r.json()["error"]["code"]) == (404, "unknown_url"), path
        assert r.json()["error"]["message"].startswith(f"Invalid URL ({method} {path}): ")
        assert "POST /v1/chat/completions" in r.json()["error"]["message"]
        assert r.headers["x-request-id"]
    r = await gateway.client.get("/not-v1")  # outside the OpenAI surface: the plain 404
    assert (r.status_code, r.json()["error"]["code"]) == (404, "not_found")
    r = await gateway.client.get(CHAT)
    assert (r.status_code, r.json()["error"]["code"]) == (405, "method_not_allowed")
    r = await gateway.client.get("/admin/tenants/x/usage?since=notadate", headers=gateway.admin)
    assert (r.status_code, r.json()["error"]["param"]) == (400, "query.since")


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize("depth", [300, 900, 1000, 1015])
@pytest.mark.parametrize(
    ("path", "head", "tail", "param"),
    [
        (
            CHAT,
            b'{"model":"standin-model","messages":[{"role":"user","content":"hi"}],'
            b'"response_format":{"type":"json_object","x":',
            b"}}",
            "response_format",
        ),
        (
            CHAT,
            b'{"model":"standin-model","messages":[{"role":"user","content":"hi"}],'
            b'"tools":[{"type":"function","function":{"name":"f","parameters":{"x":',
            b"}}}]}",
            "tools",
        ),
        ("/v1/completions", b'{"model":"standin-model","prompt":[', b"]}", "prompt"),
        (
            "/v1/responses",
            b'{"model":"standin-model","input":"hi","prompt_cache_options":{"x":',
            b"}}",
            "prompt_cache_options",
        ),
        (
            "/v1/responses",
            b'{"model":"standin-model","input":[{"role":"user","content":[{"type":"input_text",'
            b'"text":"hi","prompt_cache_breakpoint":',
            b"}]}]}",
            "input",
        ),
    ],
)
async def test_json_nested_deeper_than_served_is_a_400_naming_the_field(
    gateway, depth, path, head, tail, param
) -> None:
    """A passed-on JSON value nested up to the parser's own limit (orjson's 1024; the body's
    deepest here is 1020) is refused as too deep, a 400 naming its field -- not a RecursionError
    of a walk over it (a 500), nor a body forwarded that the engine's writer cannot write."""
    _, key = await gateway.create_tenant("acme")
    headers = {**bearer(key), "content-type": "application/json"}
    r = await gateway.client.post(path, content=head + _nested(depth) + tail, headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_request"
    assert error["param"] == param, error
    assert "nested" in error["message"], error


def _text_parts(count: int) -> list[dict]:
    return [{"type": "text", "text": "a"}] * count


def _input_parts(count: int) -> list[dict]:
    return [{"type": "input_text", "text": "a"}] * count


COUNTS_OVER_THEIR_BOUND = [
    # (path, body, param, message): each list refused on its count, before any item is read
    # (the last item of each is one the item's own check refuses: its count is what is named)
    (
        CHAT,
        _ok_chat(messages=[{"role": "user", "content": [*_text_parts(256), {"type": "x"}]}]),
        "messages.0.content",
        "at most 256 content parts",
    ),
    (
        CHAT,
        _ok_chat(messages=[{"role": "user", "content": _text_parts(256)}] * 17),
        "messages",
        "at most 4096 content parts",
    ),
    (CHAT, _ok_chat(stop=["a", "b", "c", "d", 5]), "stop", "at most 4 stop sequences"),
    (CHAT, _ok_chat(modalities=["text"] * 4 + [5]), "modalities", "at most 4 items"),
    (CHAT, _ok_chat(tools=[{"type": "function"}] * 129), "tools", "at most 128 items"),
    (
        "/v1/responses",
        {"model": MODEL, "input": [{"role": "user", "content": _input_parts(250)}] * 17},
        "input",
        "at most 4096 content parts",
    ),
    (
        "/v1/responses",
        {"model": MODEL, "input": [{"role": "user", "content": [*_input_parts(256), 5]}]},
        "input",
        "1 to 256 parts",
    ),
]


@pytest.mark.parametrize(("path", "body", "param", "message"), COUNTS_OVER_THEIR_BOUND)
async def test_a_list_over_its_bound_is_refused_on_its_count(
    gateway, path, body, param, message
) -> None:
    """Content parts (per message, per request), stop sequences and modalities are bounded by
    their count, checked before any item is validated: 310k-460k content parts of one message held
    the event loop for 2.2-2.7 s, 1024 Responses items of 254 parts 1.8 s, an 8 MiB ``stop`` list
    0.35 s before its count was looked at."""
    _, key = await gateway.create_tenant("acme")
    r = await gateway.client.post(path, json=body, headers=bearer(key))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", param), error
    assert message in error["message"], error


def _counting_surrogate_checks(monkeypatch) -> list[str]:
    import contracts.openai

    seen: list[str] = []
    check = contracts.openai._holds_surrogate

    def counted(text: str) -> bool:
        seen.append(text)
        return check(text)

    monkeypatch.setattr(contracts.openai, "_holds_surrogate", counted)
    return seen


HUGE_INTEGER = b"1" + b"0" * 400  # past a double: orjson refuses it, Python's json reads it


def _passed_on_text(extra: bytes = b"") -> bytes:
    return (
        b'{"model":"standin-model","messages":[{"role":"user","content":"hi"}],'
        b'"response_format":{"type":"json_object","x":["\xc3\xa9", {"\xc3\xbc": "\xc3\xb6"}]'
        + extra
        + b"}}"
    )


async def test_an_orjson_parsed_body_is_not_walked_for_lone_surrogates(gateway, monkeypatch):
    """orjson refuses a lone surrogate, so a body it parsed is not walked for one (the walk was
    ~1 us a JSON node: 1.2 s for an 8 MiB response_format of numbers); a body only Python's
    parser reads (here: an integer past a double's range) still is, and one holding a lone
    surrogate is still the same 400."""
    seen = _counting_surrogate_checks(monkeypatch)
    _, key = await gateway.create_tenant("acme")
    headers = {**bearer(key), "content-type": "application/json"}
    r = await gateway.client.post(CHAT, content=_passed_on_text(), headers=headers)
    assert r.status_code in (200, 400), r.text  # whatever the engine takes: read, not walked
    assert seen == []
    fallback = _passed_on_text(b',"big":' + HUGE_INTEGER)
    await gateway.client.post(CHAT, content=fallback, headers=headers)
    assert {"é", "ü", "ö"} <= set(seen)
    lone = _passed_on_text(b',"lone":"\\udc80","big":' + HUGE_INTEGER)
    r = await gateway.client.post(CHAT, content=lone, headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", "response_format"), error
    assert "lone surrogate" in error["message"]


def _schema_of(values: int) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": {"enum": [0] * values}}}


async def test_passed_on_values_share_one_budget_per_request(gateway) -> None:
    """The passed-on objects of one request hold at most ``MAX_PASSED_ON_VALUES`` JSON values in
    all, counted level by level before a level is read: an 8 MiB ``response_format`` of 2.8
    million empty lists held the event loop for 1.7 s after its parse, and 128 tools could each
    hold as much as one. Under the budget, nothing is refused for it."""
    _, key = await gateway.create_tenant("acme")
    half = MAX_PASSED_ON_VALUES // 2 + 1
    tool = {"type": "function", "function": {"name": "f", "parameters": {"enum": [0] * half}}}
    over = [
        (_ok_chat(response_format=_schema_of(MAX_PASSED_ON_VALUES + 1)), "response_format"),
        (_ok_chat(response_format=_schema_of(half), tools=[tool]), "tools"),
        (_ok_chat(tools=[tool, tool]), "tools"),
    ]
    for body, param in over:
        r = await gateway.client.post(CHAT, json=body, headers=bearer(key))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "passed-on" in error["message"], error
    r = await gateway.client.post(
        CHAT, json=_ok_chat(response_format=_schema_of(half)), headers=bearer(key)
    )
    assert "passed-on" not in r.text


def test_a_body_is_parsed_with_the_collector_paused() -> None:
    """A body of many small containers made the parse start collection after collection (1.5 s
    for an 8 MiB body of empty lists, 0.19 s without): the door parses with none, and what the
    parse made is walked once, by the young collection the first allocation after it starts."""
    import gc

    from gateway.proxy.door import _json

    collections: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start":
            collections.append(info["generation"])

    raw = b'{"x":[' + b",".join([b"[]"] * 200_000) + b"]}"
    gc.callbacks.append(seen)
    try:
        document, _ = _json(raw, "application/json")
        during = collections[:]
    finally:
        gc.callbacks.remove(seen)
    assert len(document["x"]) == 200_000
    assert during in ([], [0]), during
    assert gc.isenabled()
