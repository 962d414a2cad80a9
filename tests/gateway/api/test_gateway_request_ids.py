"""Every answer of the gateway carries its request id (``gateway.api.request_ids``), whatever
produced it: a route, a refusal, the body guard, an unknown path, a gateway bug's 500. Twice, the
same value: ``x-kvguard-request-id`` and ``x-request-id`` (what OpenAI's SDKs read); a new one per
request. The SDK's view of it is tested in test_gateway_openai_sdk.py."""

from __future__ import annotations

import httpx
from gateway_harness import Gateway, bearer

CHAT = "/v1/chat/completions"


def _request_id(r: httpx.Response) -> str:
    assert r.headers.get_list("x-request-id") == [r.headers["x-kvguard-request-id"]], r.headers
    return r.headers["x-request-id"]


async def test_every_answer_has_one_request_id_of_its_own(gateway: Gateway) -> None:
    _, key = await gateway.create_tenant("acme")

    def boom() -> None:
        raise RuntimeError("a gateway bug")

    gateway.app.add_api_route("/boom", boom)
    transport = httpx.ASGITransport(app=gateway.app, raise_app_exceptions=False)
    chat = {"model": "standin-model", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        answers = [
            await client.post(CHAT, json=chat, headers=bearer(key)),
            await client.post(CHAT, json={**chat, "stream": True}, headers=bearer(key)),
            await client.get("/v1/models", headers=bearer(key)),
            await client.post(CHAT, json={**chat, "top_p": 0}, headers=bearer(key)),
            await client.post(CHAT, json=chat, headers=bearer("kvg_nope")),
            await client.post(CHAT, content=b"x" * (1 << 24), headers=bearer(key)),
            await client.get("/v1/nothing"),
            await client.get("/health"),
            await client.get("/boom"),
        ]
    assert [r.status_code for r in answers] == [200, 200, 200, 400, 401, 413, 404, 200, 500]
    ids = [_request_id(r) for r in answers]
    assert all(len(i) == 32 for i in ids) and len(set(ids)) == len(ids)
