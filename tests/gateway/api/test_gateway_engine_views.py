"""`prefix_cache_isolation` in `GET /admin/engines` for every engine kind the gateway serves: the
bundled engine (isolated inside itself, unless an operator groups tenants), declared providers
(openai, litellm: no per-request isolation field), and vLLM and SGLang releases older than the
first that honours `cache_salt` (reported unsupported, with the release that fixes it). An engine
reported unsupported is sent no salt at all and never the client's own: stand-ins record what
they received (gateway_standin for the bundled engine and an OpenAI-compatible one,
standin_openai's provider, standin_vllm, standin_sglang)."""

from __future__ import annotations

import json
from typing import Any

from gateway_harness import bearer, running_gateway
from gateway_standin import start_standin
from standin_openai import ProviderControls, provider_app
from standin_sglang import SGLangWorker
from standin_sglang import worker_app as sglang_app
from standin_vllm import VLLMWorker
from standin_vllm import worker_app as vllm_app

from kvguard.testing import serve

CHAT = "/v1/chat/completions"
CLIENT_SALT = "the-client-chose-this"


def _declared(name: str, kind: str, url: str, model: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": name,
        "kind": kind,
        "base_url": url,
        "model": model,
        "declared_max_model_len": 4096,
        "allow_unverified": True,
        **extra,
    }


async def test_isolation_report_of_every_other_engine_kind(make_settings, monkeypatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-litellm-reads-this")
    bundled, hosted = await start_standin(), await start_standin()
    provider = ProviderControls()
    old_vllm = VLLMWorker(model="old-vllm", version="0.8.5")
    old_sglang = SGLangWorker(model="old-sglang", version="0.5.10")
    servers = [
        await serve(provider_app(provider)),
        await serve(vllm_app(old_vllm)),
        await serve(sglang_app(old_sglang)),
    ]
    provider_url, vllm_url, sglang_url = (server.url for server in servers)
    engines = [
        {"name": "bundled", "kind": "bundled", "base_url": bundled.url},
        _declared("hosted", "openai", hosted.url, "hosted-model"),
        _declared(
            "provider", "litellm", f"{provider_url}/v1", "gpt-4o-mini", litellm_model="openai/x"
        ),
        {"name": "old-vllm", "kind": "vllm", "base_url": vllm_url},
        {"name": "old-sglang", "kind": "sglang", "base_url": sglang_url},
    ]
    try:
        async with running_gateway(make_settings(engines=engines)) as gw:
            r = await gw.client.get("/admin/engines", headers=gw.admin)
            views = {e["name"]: e for e in r.json()}
            assert {name: view["prefix_cache_isolation"] for name, view in views.items()} == {
                "bundled": {
                    "supported": True,
                    "field": None,
                    "detail": "bundled engine: KV pages are never shared across tenants unless "
                    "an operator groups them (KVGUARD_PREFIX_CACHE_GROUPS)",
                },
                "hosted": {
                    "supported": False,
                    "field": None,
                    "detail": "openai: no per-request cache isolation",
                },
                "provider": {
                    "supported": False,
                    "field": None,
                    "detail": "litellm: no per-request cache isolation",
                },
                "old-vllm": {
                    "supported": False,
                    "field": None,
                    "detail": "vLLM 0.8.5: cache_salt is honoured from 0.9.0",
                },
                "old-sglang": {
                    "supported": False,
                    "field": None,
                    "detail": "SGLang 0.5.10: cache_salt is honoured from 0.5.12 (upgrade to "
                    "isolate tenants' prefix caches)",
                },
            }
            assert all(view["routable"] for view in views.values()), views

            _, key = await gw.create_tenant("acme")
            for model in ("standin-model", "hosted-model", "gpt-4o-mini", "old-vllm", "old-sglang"):
                body = {"model": model, "max_tokens": 2, "cache_salt": CLIENT_SALT}
                path, body["messages"] = CHAT, [{"role": "user", "content": "alpha beta"}]
                if model == "old-sglang":  # before 0.5.12 it counts prompts only: chats fail
                    path, body["prompt"] = "/v1/completions", body.pop("messages")[0]["content"]
                r = await gw.client.post(path, json=body, headers=bearer(key))
                assert r.status_code == 200, (model, r.text)
        received = {
            "bundled": bundled.controls.seen_bodies,
            "hosted": hosted.controls.seen_bodies,
            "provider": provider.traffic.bodies,
            "old-vllm": old_vllm.traffic.bodies,
            "old-sglang": old_sglang.traffic.bodies,
        }
        assert {name: len(bodies) for name, bodies in received.items()} == dict.fromkeys(
            received, 1
        )
        for name, bodies in received.items():  # no salt of the gateway's, none of the client's
            assert "cache_salt" not in bodies[0], name
            assert CLIENT_SALT not in json.dumps(bodies), name
    finally:
        for server in servers:
            await server.stop()
        await bundled.stop()
        await hosted.stop()
