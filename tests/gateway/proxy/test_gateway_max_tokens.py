"""A request without max_tokens gets as much as fits (OpenAI's and vLLM's default), bounded by the
engine's enforced limit, the operator's cap and the plan's tokens per minute; n choices are
charged prompt + n x max_tokens."""

from __future__ import annotations

from typing import Any

from gateway_harness import bearer, running_gateway
from gateway_standin import MESSAGE_OVERHEAD, StandInEngine

MODEL = "standin-model"
CHAT = "/v1/chat/completions"
PROMPT_TOKENS = 2 + MESSAGE_OVERHEAD  # "two words" in one user message


def _chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "two words"}], **extra}


async def test_as_much_as_fits_within_the_limit_cap_and_plan(
    make_settings: Any, standin: StandInEngine
) -> None:
    standin.controls.context_window = standin.controls.pool_tokens = 1024
    engines = [{"name": "standin", "kind": "bundled", "base_url": standin.url}]
    async with running_gateway(make_settings(engines=engines)) as gw:
        _, key = await gw.create_tenant("open")
        assert (await gw.client.post(CHAT, json=_chat(), headers=bearer(key))).status_code == 200
        assert standin.controls.seen_bodies[-1]["max_tokens"] == 1024 - PROMPT_TOKENS
        _, planned = await gw.create_tenant("planned", tokens_per_minute=500)
        r = await gw.client.post(CHAT, json=_chat(n=2), headers=bearer(planned))
        assert r.status_code == 200, r.text  # never "exceeds tokens per minute" by default
        assert standin.controls.seen_bodies[-1]["max_tokens"] == (500 - PROMPT_TOKENS) // 2
        too_many = await gw.client.post(
            CHAT, json=_chat(n=3, max_tokens=200), headers=bearer(planned)
        )
        assert too_many.status_code == 400
        assert f"needs {PROMPT_TOKENS + 600} tokens" in too_many.json()["error"]["message"]
    async with running_gateway(make_settings(engines=engines, default_max_tokens_cap=50)) as gw:
        _, key = await gw.create_tenant("capped")
        assert (await gw.client.post(CHAT, json=_chat(), headers=bearer(key))).status_code == 200
        assert standin.controls.seen_bodies[-1]["max_tokens"] == 50
        explicit = await gw.client.post(CHAT, json=_chat(max_tokens=70), headers=bearer(key))
        assert explicit.status_code == 200
        assert standin.controls.seen_bodies[-1]["max_tokens"] == 70  # the cap bounds the default


async def test_a_prompt_that_leaves_no_room_is_too_long(
    make_settings: Any, standin: StandInEngine
) -> None:
    standin.controls.context_window = standin.controls.pool_tokens = 64
    engines = [{"name": "standin", "kind": "bundled", "base_url": standin.url}]
    async with running_gateway(make_settings(engines=engines)) as gw:
        _, key = await gw.create_tenant("acme")
        words = " ".join(["w"] * (64 - MESSAGE_OVERHEAD))
        body = {"model": MODEL, "messages": [{"role": "user", "content": words}]}
        r = await gw.client.post(CHAT, json=body, headers=bearer(key))
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "context_length_exceeded"
        assert standin.controls.seen_bodies == []
