"""Preemption behind the engine's HTTP API: a real engine process whose KV pool holds any one
request but not several at once (on-demand pages, the default) preempts running requests and
recomputes them; every streamed and non-streamed answer is still a 200 equal to the same request
served alone (greedy), never a truncation or an error, and ``kvguard_engine_preemptions_total``
shows that preemption happened."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx

MODEL = "tiny-llama"
POOL_TOKENS, PAGE_SIZE = 128, 16  # 8 pages
MAX_TOKENS = 48
# 6 prompts of 29 or 42 bytes (+ BOS): alone, prompt + 48 tokens fit the pool (5 or 6 of its 8
# pages); together they need up to 33
PROMPTS = [f"request {i} asks: " + "tell me more " * (1 + i % 2) for i in range(6)]


def _body(prompt: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **fields}


async def _plain(client: httpx.AsyncClient, prompt: str) -> tuple[str, str]:
    response = await client.post("/v1/completions", json=_body(prompt))
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return choice["text"], choice["finish_reason"]


async def _streamed(client: httpx.AsyncClient, prompt: str) -> tuple[str, str]:
    text, finish = "", None
    body = _body(prompt, stream=True)
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            data = line.removeprefix("data: ")
            if not line.startswith("data: ") or data == "[DONE]":
                continue
            event = json.loads(data)
            assert "error" not in event, event
            text += event["choices"][0]["text"]
            finish = event["choices"][0]["finish_reason"] or finish
    assert finish is not None, "the stream ended without a finish_reason"
    return text, finish


def _preemptions(url: str) -> float:
    metrics = httpx.get(url + "/metrics", timeout=10).text
    found = re.search(r"^kvguard_engine_preemptions_total (\S+)$", metrics, re.M)
    assert found, "kvguard_engine_preemptions_total is not exported"
    return float(found.group(1))


def test_preempted_answers_equal_their_answers_alone(engine_factory: Any) -> None:
    url = engine_factory(
        pool_tokens=POOL_TOKENS, page_size=PAGE_SIZE, env={"KVGUARD_SERVED_MODEL_NAME": MODEL}
    )

    async def alone() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return [await _plain(client, prompt) for prompt in PROMPTS]

    async def together() -> list[tuple[str, str]]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            return list(
                await asyncio.gather(
                    *(
                        (_streamed if i % 2 else _plain)(client, prompt)
                        for i, prompt in enumerate(PROMPTS)
                    )
                )
            )

    expected = asyncio.run(alone())
    assert _preemptions(url) == 0  # each fits the pool alone
    assert asyncio.run(together()) == expected
    assert _preemptions(url) > 0
    capacity = httpx.get(url + "/engine/capacity", timeout=10).json()
    assert capacity["free_pages"] == capacity["pool_pages"]  # every page back (idle cached count)


def test_constrained_answers_survive_preemption(engine_factory: Any) -> None:
    """The grammar's state lives on the request: a constrained answer preempted mid-JSON and
    recomputed (its outputs kept, its matcher kept, nothing replayed twice) is the answer it gives
    alone, and validates."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
    import structured_cases as cases

    # 10 pages: one answer (a 47-token prompt + at most 89 tokens) fits, six together do not
    url = engine_factory(
        pool_tokens=160, page_size=PAGE_SIZE, env={"KVGUARD_SERVED_MODEL_NAME": MODEL}
    )
    bodies = [
        {**cases.schema_body(), "messages": [{"role": "user", "content": f"pet {i}"}]}
        for i in range(6)
    ]
    bodies = [{**b, "temperature": 0} for b in bodies]
    alone = [cases.answers(url, MODEL, body, 1)[0] for body in bodies]
    assert _preemptions(url) == 0

    async def together() -> list[list[dict[str, Any]]]:
        streams = [{**b, "stream": bool(i % 2)} for i, b in enumerate(bodies)]
        chat = url + "/v1/chat/completions"
        asks = (cases._answers(chat, {"model": MODEL, **b}, 1) for b in streams)
        return list(await asyncio.gather(*asks))

    both = [found[0] for found in asyncio.run(together())]
    assert _preemptions(url) > 0
    cases.check_schema_answers(both, len(bodies))
    assert [m["content"] for m in both] == [m["content"] for m in alone]
