"""A bug between the engine and the client (the detokenizer, stop matching) mid-answer: the request
ends like any failed one. Its engine requests are aborted (their pages freed), the traceback is
logged, and the client gets an OpenAI-style error: an error event and ``[DONE]`` in a stream, a 500
body otherwise, never a cut connection or a 200 with a truncated choice.

The real engine (tiny checkpoint) runs in this process under uvicorn on 127.0.0.1; the fault is a
stand-in stream decoder, wrapped around the engine's own, that raises on the token it is told to.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backend.config import BackendSettings
from backend.model.detokenizer import StreamDecoder
from backend.model.tokenizer import Tokenizer
from backend.server.app import create_app
from kvguard.testing import serve

MODEL = "tiny-llama"
POOL_TOKENS = 512
PAGE_SIZE = 16
FORCED = {"65": 100}  # every sampled token is "A": no early end of sequence
MAX_TOKENS = 200  # far more than the fault lets through: an aborted choice never gets there


class FaultyDecoder:
    """The engine's decoder, raising on push number ``fail_on`` (or in ``flush`` when None)."""

    def __init__(self, inner: StreamDecoder, fail_on: int | None) -> None:
        self.inner, self.fail_on, self.pushed = inner, fail_on, 0

    @staticmethod
    def message(fail_on: int | None) -> str:
        return f"stand-in decoder fault at {'flush' if fail_on is None else f'push {fail_on}'}"

    def push(self, token_id: int) -> str:
        self.pushed += 1
        if self.pushed == self.fail_on:
            raise RuntimeError(self.message(self.fail_on))
        return self.inner.push(token_id)

    def flush(self) -> str:
        if self.fail_on is None:
            raise RuntimeError(self.message(None))
        return self.inner.flush()


class FaultyTokenizer:
    """The engine's tokenizer, with every response's stream decoder a ``FaultyDecoder``."""

    def __init__(self, inner: Tokenizer, fail_on: int | None) -> None:
        self._inner, self._fail_on = inner, fail_on

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def stream_decoder(self, prompt_ids: Sequence[int] = ()) -> FaultyDecoder:
        return FaultyDecoder(self._inner.stream_decoder(prompt_ids), self._fail_on)


@pytest.fixture
async def engine(tiny_checkpoint: str) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    settings = BackendSettings(
        model=Path(tiny_checkpoint),
        pool_tokens=POOL_TOKENS,
        page_size=PAGE_SIZE,
        served_model_name=MODEL,
        torch_threads=1,
    )
    app = create_app(settings)
    server = await serve(app, lifespan="on")
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            yield app.state.service, client
    finally:
        await server.stop()


def _inject(monkeypatch: pytest.MonkeyPatch, service: Any, fail_on: int | None) -> None:
    monkeypatch.setattr(service, "tokenizer", FaultyTokenizer(service.tokenizer, fail_on))


async def _all_pages_free(client: httpx.AsyncClient) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if (await client.get("/engine/capacity")).json()["free_pages"] == POOL_TOKENS // PAGE_SIZE:
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the failed request's pages were not freed")


async def _counter(client: httpx.AsyncClient, name: str, **labels: str) -> float:
    """A counter of the engine's /metrics, summed over the series with these labels."""
    text = (await client.get("/metrics")).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and labels.items() <= sample.labels.items()
    )


async def _assert_ended(client: httpx.AsyncClient, fail_on: int | None, n: int) -> None:
    """Every page is free again; a choice that failed mid-answer was aborted, long before it
    could have run to max_tokens (one that failed at flush had finished already)."""
    await _all_pages_free(client)
    if fail_on is not None:
        generated = await _counter(client, "kvguard_engine_generated_tokens_total")
        assert generated < n * MAX_TOKENS / 2, f"{generated} tokens: the choices were not aborted"


async def _stream(client: httpx.AsyncClient, body: dict[str, Any]) -> list[Any]:
    events: list[Any] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _completion(**fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": MAX_TOKENS, "logit_bias": FORCED}
    return {**body, **fields}


def _assert_internal_error(error: dict[str, Any]) -> None:
    assert error == {
        "message": "internal engine error",  # names nothing internal: the log has the traceback
        "type": "server_error",
        "param": None,
        "code": "internal_error",
    }


def _assert_logged(caplog: pytest.LogCaptureFixture, fail_on: int | None) -> None:
    failed = [r for r in caplog.records if r.name == "kvguard.engine" and r.exc_info]
    assert failed, "the fault was not logged with its traceback"
    exc_info = failed[0].exc_info
    assert exc_info is not None and str(exc_info[1]) == FaultyDecoder.message(fail_on)


CASES = [
    pytest.param(3, 1, id="mid-answer"),  # after two tokens' text
    pytest.param(None, 1, id="at-flush"),  # on the finished request's last text
    pytest.param(3, 2, id="n=2"),  # one of two choices fails: the other is aborted too
]


@pytest.mark.parametrize(("fail_on", "n"), CASES)
async def test_a_stream_ends_with_an_error_event_and_done(
    engine: tuple[Any, httpx.AsyncClient],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fail_on: int | None,
    n: int,
) -> None:
    service, client = engine
    _inject(monkeypatch, service, fail_on)
    caplog.set_level(logging.ERROR, logger="kvguard.engine")

    events = await _stream(client, _completion(stream=True, n=n))

    assert events[-1] == "[DONE]"
    error = events[-2]
    _assert_internal_error(error["error"])
    assert error["kvguard"]["role"] == "unified"
    chunks = events[:-2]
    assert not any(c["choices"][0]["finish_reason"] for c in chunks), "no choice ended well"
    if n == 1:
        # up to the fault: two tokens' text, or all but the last token's, which comes with the
        # finish that the flush failed
        want = "AA" if fail_on is not None else "A" * (MAX_TOKENS - 1)
        assert "".join(c["choices"][0]["text"] for c in chunks) == want
    _assert_logged(caplog, fail_on)
    await _assert_ended(client, fail_on, n)
    # the choice that failed counts as internal_error (a sibling may have failed too, or been
    # aborted before it got there)
    failed = await _counter(client, "kvguard_engine_requests_total", outcome="internal_error")
    assert 1 <= failed <= n


@pytest.mark.parametrize(("fail_on", "n"), CASES)
async def test_a_non_streaming_answer_is_a_500_with_the_error_body(
    engine: tuple[Any, httpx.AsyncClient],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    fail_on: int | None,
    n: int,
) -> None:
    service, client = engine
    _inject(monkeypatch, service, fail_on)
    caplog.set_level(logging.ERROR, logger="kvguard.engine")

    response = await client.post("/v1/completions", json=_completion(n=n))

    assert response.status_code == 500, response.text
    body = response.json()
    _assert_internal_error(body["error"])
    assert body["kvguard"]["role"] == "unified"
    _assert_logged(caplog, fail_on)
    await _assert_ended(client, fail_on, n)


async def test_the_engine_serves_normally_after_a_fault(
    engine: tuple[Any, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    service, client = engine
    original = service.tokenizer
    _inject(monkeypatch, service, 1)
    assert (await client.post("/v1/completions", json=_completion())).status_code == 500
    monkeypatch.setattr(service, "tokenizer", original)
    answer = await client.post("/v1/completions", json=_completion())
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == "A" * MAX_TOKENS
