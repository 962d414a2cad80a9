"""OpenAI's ``x-ratelimit-*`` headers from the limiter's real state: the levels the one admit script
saw (Redis, shared by two gateway replicas; the in-process limiter the same), on whole and
streamed completion answers, Responses answers and 429s, with the reset written as OpenAI writes
it; the admit is still one round trip (a request costs Redis one admit, and one release when it
has a slot or tokens to give back)."""

from __future__ import annotations

import re

import redis
from gateway_harness import bearer, running_gateway

from gateway.domain import TenantPlan
from gateway.limits.base import Lease, Refusal, duration
from gateway.limits.memory_limiter import MemoryLimiter

BODY = {"model": "standin-model", "prompt": "one two three four", "max_tokens": 4}  # 8 tokens
NAMES = [
    f"x-ratelimit-{what}-{limit}"
    for what in ("limit", "remaining", "reset")
    for limit in ("requests", "tokens")
]


def test_reset_durations_are_written_as_openai_writes_them() -> None:
    cases = {0: "0s", 20: "20ms", 480: "480ms", 1000: "1s", 1500: "1.5s", 8640: "8.64s"}
    cases |= {20_000: "20s", 61_500: "1m1.5s", 360_000: "6m0s", 3_600_000: "1h0m0s"}
    assert {ms: duration(ms) for ms in cases} == cases


async def test_the_memory_limiter_reports_its_levels() -> None:
    now = [0]
    limiter = MemoryLimiter(clock_ms=lambda: now[0])
    plan = TenantPlan(requests_per_minute=3, tokens_per_minute=100)
    lease = limiter.admit_now(tenant_id="t", plan=plan, tokens=40)
    assert isinstance(lease, Lease)
    assert lease.levels.requests is not None and lease.levels.tokens is not None
    assert (lease.levels.requests.remaining, lease.levels.requests.reset_ms()) == (2, 20_000)
    assert (lease.levels.tokens.remaining, lease.levels.tokens.reset_ms()) == (60, 24_000)
    limiter.admit_now(tenant_id="t", plan=plan, tokens=1)
    limiter.admit_now(tenant_id="t", plan=plan, tokens=1)
    now[0] = 10_000  # half a request back
    refused = limiter.admit_now(tenant_id="t", plan=plan, tokens=1)
    assert isinstance(refused, Refusal) and refused.levels.requests is not None
    assert (refused.levels.requests.remaining, refused.levels.requests.reset_ms()) == (0, 50_000)


def _seconds(text: str) -> float:
    match = re.fullmatch(r"(?:(\d+)m)?([\d.]+)(ms|s)", text)
    assert match is not None, text
    minutes, number, unit = match.groups()
    return int(minutes or 0) * 60 + float(number) / (1000 if unit == "ms" else 1)


async def test_headers_on_answers_and_429s_from_redis(make_settings, standin, redis_url) -> None:
    engines = [{"name": "standin", "kind": "bundled", "base_url": standin.url}]
    settings = [make_settings(engines=engines, redis_url=redis_url) for _ in range(2)]
    stats = redis.Redis.from_url(redis_url)

    def commands_run() -> dict[str, int]:
        return {k: int(v["calls"]) for k, v in stats.info("commandstats").items()}

    async with running_gateway(settings[0]) as one, running_gateway(settings[1]) as two:
        _, warm = await one.create_tenant("warm", requests_per_minute=3)
        await one.client.post("/v1/completions", json=BODY, headers=bearer(warm))  # scripts loaded
        _, key = await one.create_tenant("acme", requests_per_minute=3, tokens_per_minute=1000)
        before = commands_run()
        first = await one.client.post("/v1/completions", json=BODY, headers=bearer(key))
        assert first.status_code == 200
        after = commands_run()
        # one admit (returning the levels); no release: no concurrency cap, and the answer used
        # every reserved token (nothing to refund). The commands inside the script count apart
        # (TIME, HMGET, HSET...), and nothing else is sent
        ran = {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}
        assert ran["cmdstat_evalsha"] == 1
        assert not {"cmdstat_eval", "cmdstat_script", "cmdstat_ping"} & set(ran)
        assert {name: first.headers[name] for name in NAMES} == {
            "x-ratelimit-limit-requests": "3",
            "x-ratelimit-limit-tokens": "1000",
            "x-ratelimit-remaining-requests": "2",
            "x-ratelimit-remaining-tokens": "992",
            "x-ratelimit-reset-requests": "20s",  # one request back in 60 s / 3
            "x-ratelimit-reset-tokens": "480ms",  # 8 tokens back at 1000 per minute
        }

        # The other replica reads the same buckets; a stream carries them in its head.
        async with two.client.stream(
            "POST", "/v1/completions", json={**BODY, "stream": True}, headers=bearer(key)
        ) as streamed:
            assert streamed.status_code == 200
            assert streamed.headers["content-type"].startswith("text/event-stream")
            await streamed.aread()
        assert streamed.headers["x-ratelimit-remaining-requests"] == "1"
        # 40 s less the time since the first request (bounded loosely: a loaded machine)
        assert 30 < _seconds(streamed.headers["x-ratelimit-reset-requests"]) <= 40
        assert 984 <= int(streamed.headers["x-ratelimit-remaining-tokens"]) < 1000

        third = await one.client.post("/v1/completions", json=BODY, headers=bearer(key))
        assert third.headers["x-ratelimit-remaining-requests"] == "0"
        limited = await two.client.post("/v1/completions", json=BODY, headers=bearer(key))
        assert limited.status_code == 429
        assert limited.json()["error"]["code"] == "rate_limit_exceeded"
        assert set(NAMES) <= set(limited.headers)
        assert limited.headers["x-ratelimit-remaining-requests"] == "0"
        assert 45 < _seconds(limited.headers["x-ratelimit-reset-requests"]) <= 60
        assert 1 <= int(limited.headers["retry-after"]) <= 20

        # an unlimited tenant's answers carry none
        _, free = await one.create_tenant("free")
        plain = await one.client.post("/v1/completions", json=BODY, headers=bearer(free))
        assert plain.status_code == 200 and not any(n in plain.headers for n in NAMES)

        # a Responses answer carries them as well (translated through chat on this engine)
        _, other = await one.create_tenant("responses", requests_per_minute=3)
        asked = {"model": "standin-model", "input": "one two", "max_output_tokens": 16}
        answer = await one.client.post("/v1/responses", json=asked, headers=bearer(other))
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-ratelimit-remaining-requests"] == "2"
        assert answer.headers["x-ratelimit-limit-requests"] == "3"
