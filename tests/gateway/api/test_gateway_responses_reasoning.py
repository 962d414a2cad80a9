"""A native engine reads the conversation's ``reasoning`` items, so the gateway counts, limits and
screens them: the vLLM stand-in (``standin_vllm_responses``: ``/v1/responses`` and ``/tokenize``)
behind a gateway on PostgreSQL and Redis with the canary's hooks, as in production.

- the text of a reasoning item, sent or stored from an earlier turn, counts against the plan's
  context cap and its tokens per minute like a message's;
- another tenant's canary marker in a reasoning item is refused as in a message, before the
  engine is called;
- a model served by a native and a translated engine alike: a conversation with reasoning items
  goes to the native one, whose reading of it was counted (the translated one is sent the chat
  form, which has no place for reasoning)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from gateway_harness import Gateway, bearer, running_gateway
from gateway_standin import MODEL as STANDIN_MODEL
from gateway_standin import StandInEngine
from standin_vllm_responses import VLLMResponses, serve_vllm

from canary.config import CanarySettings
from canary.runtime import CanaryRuntime
from gateway.config import GatewaySettings

CANARY_KEY = "reasoning-test-canary-key-0123456789abcdef"
MARKER = re.compile(r"CNRY-[A-Z2-7]{32}")
# 300 stand-in tokens, one per line (the stand-in streams its own reasoning split at spaces and
# joins the pieces back without them)
LONG = "\n".join(f"step{i}" for i in range(300))
LIMITS = {
    "max_context_tokens": (100, "context_length_exceeded"),
    "tokens_per_minute": (100, "exceeds_tokens_per_minute"),
}


def _user(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def _reasoning(text: str, where: str = "content") -> dict[str, Any]:
    part = "reasoning_text" if where == "content" else "summary_text"
    item: dict[str, Any] = {"type": "reasoning", "summary": []}
    item[where] = [{"type": part, "text": text}]
    return item


@pytest.fixture
async def vllm() -> AsyncIterator[tuple[VLLMResponses, str]]:
    engine = VLLMResponses(model=STANDIN_MODEL)
    server = await serve_vllm(engine)
    yield engine, server.url
    await server.stop()


@pytest.fixture
def gateway_on(
    make_settings: Callable[..., GatewaySettings], postgres_url: str, redis_url: str
) -> Callable[..., Any]:
    def start(*engines: tuple[str, str, str]) -> Any:
        settings = make_settings(
            database_url=postgres_url,
            redis_url=redis_url,
            engines=[{"name": n, "kind": k, "base_url": url} for n, k, url in engines],
        )
        hooks = CanaryRuntime(CanarySettings(canary_key=CANARY_KEY)).hooks()
        return running_gateway(settings, hooks=hooks)

    return start


async def _create(gw: Gateway, key: str, **body: Any) -> Any:
    return await gw.client.post(
        "/v1/responses",
        headers=bearer(key),
        json={"model": STANDIN_MODEL, "max_output_tokens": 16, **body},
    )


@pytest.mark.parametrize("limit", sorted(LIMITS))
@pytest.mark.parametrize("where", ["input", "history"])
async def test_reasoning_text_counts_against_the_plans_limits(
    gateway_on: Callable[..., Any], vllm: tuple[VLLMResponses, str], limit: str, where: str
) -> None:
    engine, url = vllm
    value, code = LIMITS[limit]
    async with gateway_on(("vllm", "vllm", url)) as gw:
        _, key = await gw.create_tenant("acme", **{limit: value})
        short = await _create(gw, key, input=[_reasoning("brief thought"), _user("hi")])
        assert short.status_code == 200, short.text
        assert engine.traffic.bodies[-1]["input"][0]["type"] == "reasoning"  # still forwarded
        if where == "input":
            ask: dict[str, Any] = {"input": [_reasoning(LONG), _user("hi")]}
        else:  # the engine's reasoning of the first turn, stored and sent with the second
            engine.reasoning = LONG
            first = await _create(gw, key, input="hi")
            assert first.status_code == 200, first.text
            engine.reasoning = None
            ask = {"input": "go on", "previous_response_id": first.json()["id"]}
        sent = len(engine.traffic.bodies)
        refused = await _create(gw, key, **ask)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == code
        assert len(engine.traffic.bodies) == sent  # refused before the engine was called


@pytest.mark.parametrize("where", ["message", "content", "summary"])
async def test_another_tenants_marker_in_reasoning_is_refused_as_in_a_message(
    gateway_on: Callable[..., Any], vllm: tuple[VLLMResponses, str], where: str
) -> None:
    engine, url = vllm
    async with gateway_on(("vllm", "vllm", url)) as gw:
        _, victim = await gw.create_tenant("victim", canary_sample_rate=1.0)
        answered = await _create(gw, victim, input="hello")
        assert answered.status_code == 200, answered.text
        [marker] = MARKER.findall(engine.traffic.bodies[-1]["instructions"])
        _, attacker = await gw.create_tenant("attacker")
        text = f"recall {marker} now"
        items = [_user(text)] if where == "message" else [_reasoning(text, where), _user("hi")]
        sent = len(engine.traffic.bodies)
        refused = await _create(gw, attacker, input=items)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "foreign_canary_marker"
        assert len(engine.traffic.bodies) == sent


async def test_a_conversation_with_reasoning_goes_to_the_engine_that_reads_it(
    gateway_on: Callable[..., Any], vllm: tuple[VLLMResponses, str], standin: StandInEngine
) -> None:
    engine, url = vllm
    async with gateway_on(("vllm", "vllm", url), ("recorder", "bundled", standin.url)) as gw:
        _, key = await gw.create_tenant("acme")
        for _ in range(4):  # ties between idle engines are broken round-robin
            answered = await _create(gw, key, input=[_reasoning("a thought"), _user("hi")])
            assert answered.status_code == 200, answered.text
        assert len(engine.traffic.bodies) == 4 and standin.controls.seen_bodies == []
