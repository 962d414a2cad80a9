"""Frozen shared services: Redis or PostgreSQL stopped with SIGSTOP, sockets open, nothing
answering (a hung host, a stalled disk), under the real stack (``bench.fault_stack``: the gateway
process, decode + prefill with the bundled model, private Redis and PostgreSQL).

A refused connection fails fast; a frozen server answers nothing and closes nothing, which is
where unbounded waits hide. Each test freezes one service for a few seconds, measures what
clients and operators see meanwhile, thaws it, and checks the stack serves correctly again.

- PostgreSQL: requests, `/health` and the capacity poller used to hang for the whole outage.
  Now a request that needs the database gets its 503 `database_unavailable` within the
  configured bound (`KVGUARD_DATABASE_TIMEOUT_S`, 2 s), `/health` within its own (that + 0.5 s),
  each with `LOADED_MARGIN_S` to spare, and the engine stays routable.
- Redis: an admit the gateway abandoned (it timed out; the command sat in Redis's socket and ran
  on resume) used to hold the tenant's concurrency slot for the whole lease time (60 s of 429s
  with nothing in flight). Now the first request after the thaw is served.
"""

from __future__ import annotations

import time

import httpx

from bench.fault_stack import FaultStack
from gateway.config import GatewaySettings
from kvguard.localservices import frozen

CHAT = "/v1/chat/completions"
# What a loaded two-core machine may add to a bound: scheduling, the watchdog's 50 ms tick, the
# client's own round trip. Past bound + this, the gateway did not fail closed on its own bound.
LOADED_MARGIN_S = 1.0
HEALTH_SLACK_S = 0.5  # /health waits database_timeout_s + this (gateway/api/routes/health.py)


def _body(model: str = "kvguard-tiny") -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _timed_post(client: httpx.Client, headers: dict[str, str]) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    response = client.post(CHAT, json=_body(), headers=headers)
    return response, time.monotonic() - started


def test_an_admit_abandoned_while_redis_was_frozen_does_not_hold_the_slot(
    stack: FaultStack,
) -> None:
    assert stack.redis is not None
    tenant = stack.create_tenant("frozen-redis", max_concurrency=1)
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        assert client.post(CHAT, json=_body(), headers=tenant.headers).status_code == 200
        with frozen(stack.redis):
            refused, waited = _timed_post(client, tenant.headers)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "limiter_unavailable"
        assert waited < 3.0, waited  # fails closed within its Redis timeouts, no hang
        # The abandoned admit ran when Redis resumed; the very next request is served anyway.
        served, _ = _timed_post(client, tenant.headers)
        assert served.status_code == 200, served.text


def _gateway_setting(stack: FaultStack, name: str) -> float:
    """The stack's gateway setting ``name``: its environment, else the settings' default."""
    configured = stack.gateway.env.get(f"KVGUARD_{name.upper()}")
    default = GatewaySettings.model_fields[name].default
    return float(default if configured is None else configured)


def test_a_frozen_postgres_is_a_prompt_503_and_health_and_capacity_keep_going(
    stack: FaultStack,
) -> None:
    """Every database call on the request path is bounded (``database_timeout_s``): a key the
    gateway must look up gets the documented 503 within that bound, ``/health`` answers within
    its own (the bound + 0.5 s), and the capacity poller (which used to reload from the database
    first, and so marked healthy engines stale) keeps the engine routable through the freeze."""
    assert stack.postgres is not None
    tenant = stack.create_tenant("frozen-postgres", max_concurrency=2)  # never used: not cached
    database_bound_s = _gateway_setting(stack, "database_timeout_s")
    health_bound_s = database_bound_s + HEALTH_SLACK_S
    stale_after_s = _gateway_setting(stack, "capacity_stale_after_s")
    with httpx.Client(base_url=stack.url, timeout=15) as client:
        with frozen(stack.postgres):
            frozen_at = time.monotonic()
            refused, waited = _timed_post(client, tenant.headers)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "database_unavailable"
            assert waited < database_bound_s + LOADED_MARGIN_S, (waited, database_bound_s)
            slowest = 0.0
            while time.monotonic() - frozen_at < stale_after_s + 1.5:  # past the stale bound
                started = time.monotonic()
                health = client.get("/health")
                slowest = max(slowest, time.monotonic() - started)
                assert health.status_code == 503, health.text
                assert "database unreachable" in health.json()["problems"]
            assert slowest < health_bound_s + LOADED_MARGIN_S, (slowest, health_bound_s)
            engines = health.json()["engines"]
            assert engines and all(engine["routable"] for engine in engines), engines
        deadline = time.monotonic() + 20
        while True:  # the pool's cut connections are replaced: served again
            served = client.post(CHAT, json=_body(), headers=tenant.headers)
            if served.status_code == 200 or time.monotonic() > deadline:
                break
        assert served.status_code == 200, served.text
