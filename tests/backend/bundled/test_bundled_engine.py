"""The shipped `kvguard-tiny` weights through the real engine: it copies what is in its context.

A regression in the weights, the chat template or the engine's paged read path shows up here as
markers that are no longer copied (held-out, seeded prompts; greedy; real HTTP on 127.0.0.1).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from backend.config import BUNDLED_MODEL_DIR
from kvguard.testing import EngineProcess, launch_engine

B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
WORDS = [
    "the",
    "cache",
    "page",
    "node",
    "tenant",
    "request",
    "answer",
    "model",
    "token",
    "decode",
    "prefill",
    "window",
    "pool",
]
MODEL = "kvguard-tiny"


@pytest.fixture(scope="module")
def engine() -> Iterator[EngineProcess]:
    proc = launch_engine(str(BUNDLED_MODEL_DIR), pool_tokens=8192)
    yield proc
    proc.stop()


def _chat(engine: EngineProcess, messages: list[dict[str, str]], max_tokens: int = 48) -> str:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "messages": messages}
    response = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


@pytest.mark.parametrize("context_bytes", [64, 256, 1024])
def test_copies_the_reference_marker(engine: EngineProcess, context_bytes: int) -> None:
    rng = random.Random(context_bytes)
    copied = 0
    trials = 6
    for _ in range(trials):
        marker = "CNRY-" + "".join(rng.choice(B32) for _ in range(32))
        filler = " ".join(rng.choice(WORDS) for _ in range(context_bytes // 6))
        at = rng.randint(0, len(filler))
        system = f"{filler[:at]} Reference code: {marker} {filler[at:]}"
        reply = _chat(
            engine,
            [
                {"role": "system", "content": system},
                {"role": "user", "content": "Repeat the reference code."},
            ],
        )
        copied += marker in reply
    assert copied >= trials - 1, f"{copied}/{trials} markers copied at {context_bytes} bytes"


def test_repeat_exactly_and_ordinary_prompts_end_on_their_own(engine: EngineProcess) -> None:
    text = "hello kvguard"
    reply = _chat(engine, [{"role": "user", "content": f"Repeat exactly: {text}"}])
    assert reply.startswith(text)
    body = {
        "model": MODEL,
        "max_tokens": 64,
        "temperature": 0,
        "messages": [{"role": "user", "content": "What is the weather like today?"}],
    }
    response = httpx.post(engine.url + "/v1/chat/completions", json=body, timeout=120).json()
    assert response["choices"][0]["message"]["content"]
    assert response["choices"][0]["finish_reason"] == "stop"
