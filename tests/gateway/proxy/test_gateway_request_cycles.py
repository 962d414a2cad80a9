"""A finished request leaves no reference cycle behind: what it touched (its flight, context,
guards, readers, reply, parsed body, lease) is freed when it ends, by reference counting.

Everything in a cycle waits for the garbage collector instead; what survives two young
collections (a request in flight does) is promoted, and the full collections that free it walk
the whole live heap while every request waits. Two cycles made each request garbage of about
sixty objects: the data-plane handle in the scope held uvicorn's cycle, whose scope held the
handle; and the answer's disclosure held the flight's bound method. This runs the gateway under
its own server protocol, with the canary's firewall guarding every answer, and checks refusals
(400, 401, 429) too."""

from __future__ import annotations

import gc
from collections import Counter

from gateway_harness import bearer, running_gateway

from canary.config import CanarySettings
from canary.runtime import CanaryRuntime

CANARY_KEY = "canary-test-key-0123456789abcdef0123456789"
OURS = ("gateway", "canary", "contracts")


async def test_a_finished_request_leaves_no_reference_cycle(make_settings, standin) -> None:
    settings = make_settings(engines=[{"name": "s", "base_url": standin.url}])
    hooks = CanaryRuntime(CanarySettings(canary_key=CANARY_KEY)).hooks()
    async with running_gateway(settings, hooks=hooks) as gw:
        _, key = await gw.create_tenant("acme", canary_sample_rate=1.0)  # marked: every path
        bodies = {
            "/v1/completions": {"model": "standin-model", "prompt": "one two", "max_tokens": 3},
            "/v1/chat/completions": {
                "model": "standin-model",
                "messages": [{"role": "user", "content": "one two"}],
                "max_tokens": 3,
            },
            "/v1/responses": {"model": "standin-model", "input": "one two"},  # stored
        }

        _, limited = await gw.create_tenant("limited", requests_per_minute=1)
        used = await gw.client.post(
            "/v1/completions", json=bodies["/v1/completions"], headers=bearer(limited)
        )
        assert used.status_code == 200, used.text  # its one request of the minute

        async def both() -> None:
            for path, body in bodies.items():
                for stream in (False, True):
                    r = await gw.client.post(
                        path, json={**body, "stream": stream}, headers=bearer(key)
                    )
                    assert r.status_code == 200, (path, r.text)
            refusals = [  # a refusal is a request's end too
                (bearer(key), {"model": "standin-model"}, 400),
                (bearer("kvg_not_a_key"), bodies["/v1/completions"], 401),
                (bearer(limited), bodies["/v1/completions"], 429),
            ]
            for headers, body, status in refusals:
                r = await gw.client.post("/v1/completions", json=body, headers=headers)
                assert r.status_code == status, r.text

        await both()  # first-use work (caches, lazy imports) is not the request's
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for _ in range(5):
                await both()
            gc.collect()
            ours = Counter(
                type(o).__qualname__
                for o in gc.garbage
                if getattr(type(o), "__module__", "").split(".")[0] in OURS
            )
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert not ours, ours
