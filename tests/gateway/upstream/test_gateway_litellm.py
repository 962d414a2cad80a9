"""The litellm upstream path (offline), against the stand-in engine's OpenAI-compatible routes:
an engine of our own deployment reached through litellm (it opts in to the gateway's headers; its
credential comes from litellm's own environment variable)."""

from __future__ import annotations

import json

from gateway_harness import bearer, running_gateway
from openai_contract import check, check_response_events

WORDS = "alpha beta gamma"


def _spec(standin) -> dict:
    return {
        "name": "via-litellm",
        "kind": "litellm",
        "base_url": f"{standin.url}/v1",
        "model": "standin-model",
        "litellm_model": "openai/standin-model",
        "declared_max_model_len": 4096,
        "allow_unverified": True,
        "send_kvguard_headers": True,
    }


async def test_litellm_chat_and_completions(make_settings, standin, monkeypatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-environment")
    async with running_gateway(make_settings(engines=[_spec(standin)])) as gw:
        tenant_id, key = await gw.create_tenant("acme")
        chat = {
            "model": "standin-model",
            "messages": [{"role": "user", "content": WORDS}],
            "max_tokens": 5,
        }
        r = await gw.client.post("/v1/chat/completions", json=chat, headers=bearer(key))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == WORDS
        assert standin.controls.seen_headers[-1]["x-kvguard-tenant"] == tenant_id
        assert (
            standin.controls.seen_headers[-1]["authorization"] == "Bearer sk-from-the-environment"
        )

        r = await gw.client.post(
            "/v1/chat/completions", json={**chat, "stream": True}, headers=bearer(key)
        )
        assert r.status_code == 200
        events = [e.removeprefix("data: ") for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        text = "".join(
            (c.get("delta") or {}).get("content") or ""
            for e in events[:-1]
            for c in json.loads(e).get("choices", [])
        )
        assert text == WORDS

        r = await gw.client.post(
            "/v1/completions",
            headers=bearer(key),
            json={"model": "standin-model", "prompt": WORDS, "max_tokens": 5},
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == WORDS

        standin.controls.refuse_above = 5
        r = await gw.client.post("/v1/chat/completions", json=chat, headers=bearer(key))
        assert r.status_code == 400 and "error" in r.json()


async def test_api_base_false_leaves_the_endpoint_to_the_provider_config(
    make_settings, standin, monkeypatch
) -> None:
    """``api_base = false``: litellm is given no api_base, so the provider's own configuration
    (here litellm's ``OPENAI_BASE_URL``) picks the endpoint; base_url is only a label and points
    at a port nothing listens on."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-environment")
    monkeypatch.setenv("OPENAI_BASE_URL", f"{standin.url}/v1")
    label_only = {**_spec(standin), "base_url": "http://127.0.0.1:9/v1", "api_base": False}
    async with running_gateway(make_settings(engines=[label_only])) as gw:
        _, key = await gw.create_tenant("acme")
        chat = {
            "model": "standin-model",
            "messages": [{"role": "user", "content": WORDS}],
            "max_tokens": 5,
        }
        r = await gw.client.post("/v1/chat/completions", json=chat, headers=bearer(key))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == WORDS
        assert standin.controls.seen_headers[-1]["authorization"] == (
            "Bearer sk-from-the-environment"
        )


async def test_litellm_serves_the_responses_api_translated(
    make_settings, standin, monkeypatch
) -> None:
    """A provider through litellm gets ``/v1/responses`` as a chat completion (it serves no
    Responses API of its own here), whole and streamed, schema-valid."""
    monkeypatch.setenv("OPENAI_API_KEY", "sk-from-the-environment")
    async with running_gateway(make_settings(engines=[_spec(standin)])) as gw:
        _, key = await gw.create_tenant("acme")
        body = {"model": "standin-model", "input": WORDS, "max_output_tokens": 16}
        r = await gw.client.post("/v1/responses", json=body, headers=bearer(key))
        assert r.status_code == 200, r.text
        answer = check("Response", r.json())
        assert answer["output"][0]["content"][0]["text"] == WORDS
        assert standin.controls.seen_bodies[-1]["messages"][-1]["content"] == WORDS
        r = await gw.client.post(
            "/v1/responses",
            json={**body, "stream": True, "previous_response_id": answer["id"]},
            headers=bearer(key),
        )
        events = check_response_events(r.content)
        assert events[-1]["type"] == "response.completed"
        assert [m["role"] for m in standin.controls.seen_bodies[-1]["messages"]] == [
            "user",
            "assistant",
            "user",
        ]
