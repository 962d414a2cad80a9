"""The OpenAI request surface at the door: every published field is read and decided by one table
(``gateway.api.surface``), rendered into gateway/README.md; what an engine kind does not take is a
400 naming the field and the engine before the request touches the tenant's limits; what asks for
nothing is accepted and left out; a request goes only to engines that take all of it."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from gateway_harness import Gateway, bearer, running_gateway
from gateway_standin import StandInEngine, start_standin
from openai_contract import check, request_fields

from gateway.api import surface
from gateway.api.schemas_openai import ChatCompletionBody, CompletionBody

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
    assert found.group(1) == surface.render_markdown(), "run: python -m gateway.api.surface"


async def test_a_refused_field_is_a_400_naming_field_and_engine_before_any_limit(
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
        assert "engine 'standin' (bundled)" in error["message"]
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
