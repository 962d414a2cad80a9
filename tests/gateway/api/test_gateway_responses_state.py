"""The Responses API's stored state is the tenant's alone, on PostgreSQL and Redis as in
production: another tenant's response id answers every route exactly as an id never issued (status,
body, and time: interleaved lookups, medians compared), and the state is the database's, not a
replica's (create on one gateway, continue on another, and after a restart); what is stored can
always be read back: continued, and listed page by page. The engine is the bundled-kind stand-in
(``gateway_standin``), which records what it was sent, or, where a test scripts tool calls, the
vLLM stand-in's chat routes declared as an OpenAI-compatible engine."""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import statistics
import time
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import httpx
import openai
import psycopg
import pytest
import redis
from gateway_harness import Gateway, bearer, running_gateway
from gateway_standin import StandInEngine
from openai_contract import check_response_events
from sqlalchemy import event, select
from standin_openai import Script, ToolCall
from standin_vllm import VLLMWorker, worker_app

from contracts.sql import session_scope
from gateway.config import GatewaySettings
from gateway.db.models import StoredResponse
from kvguard.testing import serve

ROUNDS = 51
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


@pytest.fixture
def pg_settings(
    make_settings: Callable[..., GatewaySettings],
    postgres_url: str,
    redis_url: str,
    standin: StandInEngine,
) -> Callable[[], GatewaySettings]:
    def make() -> GatewaySettings:
        return make_settings(
            database_url=postgres_url,
            redis_url=redis_url,
            engines=[{"name": "standin", "kind": "bundled", "base_url": standin.url}],
        )

    return make


@pytest.fixture
async def provider(
    make_settings: Callable[..., GatewaySettings], postgres_url: str, redis_url: str
) -> AsyncIterator[tuple[VLLMWorker, GatewaySettings]]:
    """A declared OpenAI-compatible engine (the vLLM stand-in's chat routes) that answers what a
    test scripts, tool calls among it, translated through ``ChatToResponses``; and settings on
    PostgreSQL and Redis for it."""
    worker = VLLMWorker(model="hosted")
    server = await serve(worker_app(worker))
    engine = {
        "name": "hosted",
        "kind": "openai",
        "base_url": server.url,
        "model": "hosted",
        "declared_max_model_len": 4096,
        "allow_unverified": True,
    }
    settings = make_settings(database_url=postgres_url, redis_url=redis_url, engines=[engine])
    try:
        yield worker, settings
    finally:
        await server.stop()


def _rewrite(gw: Gateway, response_id: str, change: Callable[[StoredResponse], None]) -> None:
    """Change a stored row into one an earlier gateway wrote."""
    with session_scope(gw.state.sessions) as session:
        query = select(StoredResponse).where(StoredResponse.id == response_id)
        change(session.execute(query).scalar_one())


@contextlib.asynccontextmanager
async def _gateway(settings: GatewaySettings) -> AsyncIterator[Gateway]:
    async with running_gateway(settings) as gw:
        yield gw


async def _model(gw: Gateway, key: str) -> str:
    listed = await gw.client.get("/v1/models", headers=bearer(key))
    return str(listed.json()["data"][0]["id"])


def _never_issued() -> str:
    return "resp_" + secrets.token_hex(24)


def _as_missing(response: httpx.Response, asked: str) -> tuple[int, str]:
    """Status and body, the id the client sent written as ID (every miss names what it asked)."""
    return response.status_code, response.text.replace(asked, "ID")


async def _each_route(
    client: httpx.AsyncClient, key: str, model: str, response_id: str
) -> list[tuple[int, str]]:
    """What tenant ``key`` gets for ``response_id`` on every route that takes one."""
    headers = bearer(key)
    answers = [
        await client.get(f"/v1/responses/{response_id}", headers=headers),
        await client.get(f"/v1/responses/{response_id}/input_items", headers=headers),
        await client.post(f"/v1/responses/{response_id}/cancel", headers=headers),
        await client.delete(f"/v1/responses/{response_id}", headers=headers),
        await client.post(
            "/v1/responses",
            headers=headers,
            json={"model": model, "input": "go on", "previous_response_id": response_id},
        ),
    ]
    return [_as_missing(answer, response_id) for answer in answers]


async def _timed(send: Callable[[str], Any], response_id: str) -> float:
    started = time.perf_counter()
    response = await send(response_id)
    elapsed = time.perf_counter() - started
    assert response.status_code == 404
    return elapsed


async def test_another_tenants_response_answers_as_one_never_issued(
    pg_settings: Callable[[], GatewaySettings], standin: StandInEngine
) -> None:
    async with _gateway(pg_settings()) as gw:
        _, key_a = await gw.create_tenant("tenant-a")
        _, key_b = await gw.create_tenant("tenant-b")
        model = await _model(gw, key_a)
        created = await gw.client.post(
            "/v1/responses",
            headers=bearer(key_a),
            json={"model": model, "input": "tenant A's secret plan", "max_output_tokens": 16},
        )
        assert created.status_code == 200, created.text
        a_id = created.json()["id"]
        sent_before = len(standin.controls.seen_bodies)

        foreign = await _each_route(gw.client, key_b, model, a_id)
        never = await _each_route(gw.client, key_b, model, _never_issued())
        malformed = await _each_route(gw.client, key_b, model, "resp_not-one-of-ours")
        assert foreign == never == malformed
        assert {status for status, _ in foreign} == {404}
        assert all("not_found" in body and "secret" not in body for _, body in foreign)
        assert len(standin.controls.seen_bodies) == sent_before  # B's continuation never ran

        # A's response is untouched by B's delete, cancel and continuation
        mine = await gw.client.get(f"/v1/responses/{a_id}", headers=bearer(key_a))
        assert mine.status_code == 200 and mine.json() == created.json()
        items_of_a = await gw.client.get(f"/v1/responses/{a_id}/input_items", headers=bearer(key_a))
        listed = items_of_a.json()["data"]
        assert listed[0]["content"][0]["text"] == "tenant A's secret plan"
        # the owner's own cancel is the only 400: its response exists
        cancel = await gw.client.post(f"/v1/responses/{a_id}/cancel", headers=bearer(key_a))
        assert cancel.status_code == 400

        # No timing oracle: on every route, B's requests for A's id and for ids never issued,
        # interleaved in random order per round, take the same time (medians: robust to a noisy
        # machine).
        async def lookup(response_id: str) -> httpx.Response:
            return await gw.client.get(f"/v1/responses/{response_id}", headers=bearer(key_b))

        async def items(response_id: str) -> httpx.Response:
            path = f"/v1/responses/{response_id}/input_items"
            return await gw.client.get(path, headers=bearer(key_b))

        async def cancel(response_id: str) -> httpx.Response:
            path = f"/v1/responses/{response_id}/cancel"
            return await gw.client.post(path, headers=bearer(key_b))

        async def delete(response_id: str) -> httpx.Response:
            return await gw.client.delete(f"/v1/responses/{response_id}", headers=bearer(key_b))

        async def resume(response_id: str) -> httpx.Response:
            body = {"model": model, "input": "go on", "previous_response_id": response_id}
            return await gw.client.post("/v1/responses", headers=bearer(key_b), json=body)

        rng = random.Random(29)
        for route in (lookup, items, cancel, delete, resume):
            times: dict[str, list[float]] = {"foreign": [], "never": []}
            for _ in range(ROUNDS):
                pair = [("foreign", a_id), ("never", _never_issued())]
                rng.shuffle(pair)
                for name, response_id in pair:
                    times[name].append(await _timed(route, response_id))
            # the median of the per-round differences: a slow spell hits both ids of its round
            rounds = zip(times["foreign"], times["never"], strict=True)
            gap = statistics.median(f - n for f, n in rounds)
            typical = statistics.median(times["foreign"] + times["never"])
            assert abs(gap) <= 0.2 * typical + 0.0005, (route.__name__, gap, typical)
        assert (await gw.client.get(f"/v1/responses/{a_id}", headers=bearer(key_a))).is_success


async def test_the_state_is_shared_by_replicas_and_survives_a_restart(
    pg_settings: Callable[[], GatewaySettings], standin: StandInEngine
) -> None:
    settings = pg_settings().model_copy(update={"responses_retention_days": 2.0})
    async with _gateway(settings) as one, _gateway(settings) as two:
        _, key = await one.create_tenant("acme")
        model = await _model(one, key)
        first = await one.client.post(
            "/v1/responses",
            headers=bearer(key),
            json={"model": model, "input": "first question", "max_output_tokens": 16},
        )
        assert first.status_code == 200, first.text
        # continued on the other replica: the engine receives the first turn from the database
        second = await two.client.post(
            "/v1/responses",
            headers=bearer(key),
            json={
                "model": model,
                "input": "second question",
                "previous_response_id": first.json()["id"],
                "max_output_tokens": 16,
                "stream": True,
            },
        )
        assert second.status_code == 200 and "response.completed" in second.text
        sent = standin.controls.seen_bodies[-1]["messages"]
        assert [m["content"] for m in sent if m["role"] == "user"] == [
            "first question",
            "second question",
        ]
        assert "previous_response_id" not in standin.controls.seen_bodies[-1]
        second_id = second.text.split('"id":"', 1)[1].split('"', 1)[0]
        fetched = await one.client.get(f"/v1/responses/{second_id}", headers=bearer(key))
        assert fetched.status_code == 200 and fetched.json()["previous_response_id"]
        with session_scope(one.state.sessions) as session:
            kept = session.execute(select(StoredResponse)).scalars().all()
            assert {row.id for row in kept} == {first.json()["id"], second_id}
            assert {row.expires_at - row.created_at for row in kept} == {timedelta(days=2)}

    # every gateway stopped; a new one on the same database still has the conversation
    async with _gateway(settings) as restarted:
        again = await restarted.client.get(f"/v1/responses/{second_id}", headers=bearer(key))
        assert again.json() == fetched.json()
        third = await restarted.client.post(
            "/v1/responses",
            headers=bearer(key),
            json={
                "model": model,
                "input": "third question",
                "previous_response_id": second_id,
                "max_output_tokens": 16,
            },
        )
        assert third.status_code == 200, third.text
        sent = standin.controls.seen_bodies[-1]["messages"]
        assert [m["content"] for m in sent if m["role"] == "user"] == [
            "first question",
            "second question",
            "third question",
        ]
        assert [m["role"] for m in sent].count("assistant") == 2  # both earlier answers


async def test_bad_requests_get_a_400_naming_the_field(
    pg_settings: Callable[[], GatewaySettings], standin: StandInEngine
) -> None:
    """What the gateway does not serve is refused before any engine work, with OpenAI's error
    shape naming the field; a key is required on every route."""
    async with _gateway(pg_settings()) as gw:
        _, key = await gw.create_tenant("acme")
        model = await _model(gw, key)
        sent_before = len(standin.controls.seen_bodies)
        for extra, param in [
            ({"background": True}, "background"),
            ({"conversation": "conv_1"}, "conversation"),
            ({"include": ["reasoning.encrypted_content"]}, "include"),
            ({"max_output_tokens": 3}, "max_output_tokens"),
            ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ]:
            body = {"model": model, "input": "hi", **extra}
            r = await gw.client.post("/v1/responses", headers=bearer(key), json=body)
            assert r.status_code == 400, (extra, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert len(standin.controls.seen_bodies) == sent_before
        unknown = {"model": "nobody-serves-this", "input": "hi"}
        r = await gw.client.post("/v1/responses", headers=bearer(key), json=unknown)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = await gw.client.get("/v1/responses/x/input_items?limit=101", headers=bearer(key))
        assert r.status_code == 400
        r = await gw.client.get(f"/v1/responses/{_never_issued()}?stream=true", headers=bearer(key))
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
        queries = ("include[]=reasoning.encrypted_content", "include=message.output_text.logprobs")
        for query in queries:
            for path in (f"/v1/responses/{_never_issued()}", "/v1/responses/x/input_items"):
                r = await gw.client.get(f"{path}?{query}", headers=bearer(key))
                assert r.status_code == 400 and r.json()["error"]["param"] == "include", r.text
        for method, path in [
            ("POST", "/v1/responses"),
            ("GET", f"/v1/responses/{_never_issued()}"),
            ("DELETE", f"/v1/responses/{_never_issued()}"),
            ("GET", f"/v1/responses/{_never_issued()}/input_items"),
            ("POST", f"/v1/responses/{_never_issued()}/cancel"),
        ]:
            r = await gw.client.request(method, path, json={"model": model, "input": "hi"})
            assert r.status_code == 401, (method, path, r.text)


async def test_a_handoff_mismatch_fails_the_response_and_stores_nothing(
    gateway: Gateway, standin: StandInEngine
) -> None:
    """An engine whose handoff proof shows its KV may not be this request's: the whole answer is
    chat's 502 ``handoff_mismatch`` (its text never sent), the stream ends with an ``error``
    event and a ``response.failed`` naming it (never "completed"; sequence numbers unbroken),
    nothing is stored."""
    _, key = await gateway.create_tenant("acme")
    model = await _model(gateway, key)
    standin.controls.handoff = {"outcome": "ok", "reserved_tokens": 12, "transferred_tokens": 1}
    body = {"model": model, "input": "alpha beta gamma", "max_output_tokens": 16}
    whole = await gateway.client.post("/v1/responses", headers=bearer(key), json=body)
    assert (whole.status_code, whole.json()["error"]["code"]) == (502, "handoff_mismatch")
    assert "gamma" not in whole.text
    streamed = await gateway.client.post(
        "/v1/responses", headers=bearer(key), json={**body, "stream": True}
    )
    events = check_response_events(streamed.content)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["code"] == "handoff_mismatch"  # the proof comes with the usage, last
    assert "response.completed" not in streamed.text
    failed_id = events[-1]["response"]["id"]
    missing = await gateway.client.get(f"/v1/responses/{failed_id}", headers=bearer(key))
    assert missing.status_code == 404


async def test_a_client_leaving_a_responses_stream_releases_its_lease(
    pg_settings: Callable[[], GatewaySettings], standin: StandInEngine, redis_url: str
) -> None:
    """The Responses stream leaves through chat's single exit: a client that goes away after the
    first bytes frees its concurrency lease (max_concurrency 1: the next request is served) and
    the engine's stream is closed; the unfinished response is not stored."""
    standin.controls.chunk_delay_s = 0.05
    async with _gateway(pg_settings()) as gw:
        tenant_id, key = await gw.create_tenant("acme", max_concurrency=1)
        model = await _model(gw, key)
        body = {"model": model, "input": " ".join(["word"] * 200), "stream": True}
        async with gw.client.stream(
            "POST", "/v1/responses", json={**body, "max_output_tokens": 256}, headers=bearer(key)
        ) as response:
            assert response.status_code == 200
            first = b""
            async for chunk in response.aiter_bytes():
                first = chunk
                break  # the client goes away after the first chunk
        started = first.decode().split('"id":"', 1)[1].split('"', 1)[0]
        leases = redis.Redis.from_url(redis_url)
        lease_key = f"kvg:lim:{{{tenant_id}}}:leases"
        deadline = time.monotonic() + 10
        while (leases.zcard(lease_key) or standin.controls.active_streams) and (
            time.monotonic() < deadline
        ):
            await asyncio.sleep(0.02)  # polled, bounded: the exit runs once the client is gone
        assert leases.zcard(lease_key) == 0 and standin.controls.active_streams == 0
        standin.controls.chunk_delay_s = 0.0
        after = await gw.client.post(
            "/v1/responses",
            headers=bearer(key),
            json={"model": model, "input": "next", "max_output_tokens": 16},
        )
        assert after.status_code == 200, after.text
        missing = await gw.client.get(f"/v1/responses/{started}", headers=bearer(key))
        assert missing.status_code == 404


async def test_a_stream_whose_save_fails_ends_failed_after_whole_events(
    pg_settings: Callable[[], GatewaySettings], standin: StandInEngine
) -> None:
    """A completed stream the gateway could not store ends with an ``error`` event and a
    ``response.failed`` in place of its ``response.completed``, after the events that went before
    it, each whole: even when the answer's own text reads like an event's head (the place where
    the terminal event starts is not searched for in the bytes)."""
    async with _gateway(pg_settings()) as gw:
        _, key = await gw.create_tenant("acme")
        model = await _model(gw, key)
        engine = gw.state.sessions.kw["bind"]

        def down(conn, cursor, statement, parameters, context, executemany) -> None:  # type: ignore[no-untyped-def]
            if statement.lstrip().upper().startswith("INSERT INTO STORED_RESPONSES"):
                raise psycopg.InterfaceError("the connection is closed")

        body = {"model": model, "input": "say event: response.completed", "stream": True}
        event.listen(engine, "before_cursor_execute", down)
        try:
            streamed = await gw.client.post("/v1/responses", headers=bearer(key), json=body)
        finally:
            event.remove(engine, "before_cursor_execute", down)
        assert streamed.status_code == 200
        events = check_response_events(streamed.content)  # every event whole, numbered in order
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert events[-2]["code"] == "database_unavailable"
        assert "response.completed" not in [e["type"] for e in events]
        texts = [e["text"] for e in events if e["type"] == "response.output_text.done"]
        assert texts == ["say event: response.completed"]


async def test_an_engine_call_no_later_turn_could_send_back_fails_and_is_not_stored(
    provider: tuple[VLLMWorker, GatewaySettings],
) -> None:
    """A function call the engine named outside OpenAI's function-name form (the bundled engine
    takes any name its model writes) is an upstream error for that answer -- whole: a 502,
    streamed: ``error`` + ``response.failed`` -- never renamed and never stored: stored, it made
    every continuation of its chain a 500."""
    engine, settings = provider
    engine.script = Script(tool_calls=[ToolCall("get weather", '{"city": "Oslo"}')])
    body = {"model": "hosted", "input": "weather in Oslo?", "tools": [WEATHER]}
    async with _gateway(settings) as gw:
        _, key = await gw.create_tenant("acme")
        whole = await gw.client.post("/v1/responses", headers=bearer(key), json=body)
        assert (whole.status_code, whole.json()["error"]["code"]) == (502, "upstream_error")
        streamed = await gw.client.post(
            "/v1/responses", headers=bearer(key), json={**body, "stream": True}
        )
        events = check_response_events(streamed.content)
        assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
        assert events[-2]["code"] == "upstream_error" and b"get weather" not in streamed.content
        failed_id = events[-1]["response"]["id"]
        missing = await gw.client.get(f"/v1/responses/{failed_id}", headers=bearer(key))
        assert missing.status_code == 404
        with session_scope(gw.state.sessions) as session:
            assert session.execute(select(StoredResponse.id)).first() is None


async def test_a_chain_stored_with_such_a_call_is_a_400_naming_previous_response_id(
    provider: tuple[VLLMWorker, GatewaySettings],
) -> None:
    """A chain an earlier gateway stored with such a call (it did not check the names engines
    write) cannot be continued: a 400 naming ``previous_response_id`` and the stored item,
    OpenAI's error shape, no engine asked -- never the 500 of an unhandled error."""
    engine, settings = provider
    engine.script = Script(tool_calls=[ToolCall("get_weather", '{"city": "Oslo"}')])
    body = {"model": "hosted", "input": "weather in Oslo?", "tools": [WEATHER]}
    async with _gateway(settings) as gw:
        _, key = await gw.create_tenant("acme")
        first = await gw.client.post("/v1/responses", headers=bearer(key), json=body)
        assert first.status_code == 200, first.text
        response = first.json()
        [called] = response["output"]

        def as_the_engine_wrote_it(row: StoredResponse) -> None:
            row.response = {**row.response, "output": [{**called, "name": "get weather"}]}

        _rewrite(gw, response["id"], as_the_engine_wrote_it)
        sent_before = len(engine.traffic.bodies)
        result = {"type": "function_call_output", "call_id": called["call_id"], "output": "sun"}
        for stream in (False, True):
            continued = await gw.client.post(
                "/v1/responses",
                headers=bearer(key),
                json={
                    **body,
                    "input": [result],
                    "previous_response_id": response["id"],
                    "stream": stream,
                },
            )
            assert continued.status_code == 400, continued.text
            error = continued.json()["error"]
            assert error["param"] == "previous_response_id", error
            assert error["type"] == "invalid_request_error", error
            assert error["message"].startswith(
                "the stored conversation cannot be continued: stored item 1: name: "
            ), error
        assert len(engine.traffic.bodies) == sent_before


async def test_repeated_input_item_ids_are_refused_and_an_old_turn_with_them_lists_whole(
    pg_settings: Callable[[], GatewaySettings],
) -> None:
    """Two input items with one id are OpenAI's 400 (``Duplicate item found with id ...``, param
    ``input``). A turn an earlier gateway stored with an id repeated is listed whole by the SDK's
    auto-pagination (``after`` the last item's id), each item once, and the listing ends: it
    used to go round for ever."""
    texts = ["c", "x1", "b", "x2", "a"]
    ids = ["msg_c", "msg_x", "msg_b", "msg_y", "msg_a"]
    items = [
        {"type": "message", "role": "user", "id": item_id, "content": text}
        for item_id, text in zip(ids, texts, strict=True)
    ]
    async with _gateway(pg_settings()) as gw:
        _, key = await gw.create_tenant("acme")
        model = await _model(gw, key)
        body = {"model": model, "max_output_tokens": 16}
        repeated = [*items[:3], {**items[3], "id": "msg_x"}, items[4]]
        refused = await gw.client.post(
            "/v1/responses", headers=bearer(key), json={**body, "input": repeated}
        )
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "input" and error["type"] == "invalid_request_error", error
        assert "Duplicate item found with id msg_x." in error["message"], error

        created = await gw.client.post(
            "/v1/responses", headers=bearer(key), json={**body, "input": items}
        )
        assert created.status_code == 200, created.text
        response_id = created.json()["id"]

        def with_an_id_repeated(row: StoredResponse) -> None:
            conversation = [dict(item) for item in row.conversation]
            conversation[row.input_start + 3]["id"] = "msg_x"
            row.conversation = conversation

        _rewrite(gw, response_id, with_an_id_repeated)
        base_url = str(gw.client.base_url).rstrip("/")
        client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0)
        for order, expected in (("asc", texts), ("desc", texts[::-1])):
            for limit in (1, 2, 3, 20):
                listed = []
                pages = client.responses.input_items.list(response_id, limit=limit, order=order)
                async for item in pages:
                    listed.append(item.content[0].text)
                    assert len(listed) <= len(texts), (order, limit, listed)  # not round again
                assert listed == expected, (order, limit)
        await client.close()
