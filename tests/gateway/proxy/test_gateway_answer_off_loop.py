"""A long whole answer is screened off the event loop (``gateway.proxy.body.off_loop``): the
same result as on the loop, and the loop keeps serving every other tenant meanwhile.

The answers are what a tenant can steer the model to write: ``logprobs`` with ``top_logprobs``
20 of tokens that spell marker look-alikes (every fourth token closes one to strip) cost the
firewall about a millisecond a token, and held the loop for all of it."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

from canary.firewall import LeakFirewall, TagIndex
from canary.injection import MarkerLedger, RequestMarkers
from canary.markers import MarkerCodec, MarkerKeyring
from contracts.plugins import Cut, RequestInfo
from gateway.proxy.body import OFF_LOOP_CHARS, off_loop, on_loop, relay_body
from gateway.upstream.base import Endpoint

CODEC = MarkerCodec(MarkerKeyring({1: bytes(range(32))}, current=1))
OWNER, OTHER = "acme", "globex"
OWN = CODEC.issue(OWNER, nonce=b"own-req1")
FOREIGN = CODEC.issue(OTHER, nonce=b"foreign1")
INFO = RequestInfo("r1", OWNER, "m", "chat.completions", False, 0.0, engine="e1")


def firewall() -> LeakFirewall:
    ledger = MarkerLedger()
    ledger.put(INFO.request_id, RequestMarkers(own=frozenset({OWN.nonce})))
    tags = TagIndex(CODEC)
    tags.replace([OWNER, OTHER])
    return LeakFirewall(CODEC, ledger=ledger, tags=tags)


def answer(content: str, tokens: list[str]) -> tuple[dict[str, Any], str]:
    entries = [
        {
            "token": t,
            "logprob": -0.1,
            "bytes": list(t.encode()),
            "top_logprobs": [{"token": t, "logprob": -0.2, "bytes": list(t.encode())}] * 20,
        }
        for t in tokens
    ]
    message = {"role": "assistant", "content": content}
    choice = {"index": 0, "message": message, "finish_reason": "stop"}
    choice["logprobs"] = {"content": entries}
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m"}
    body |= {"choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    return body, json.dumps(body)


def screened_on_the_loop(body: dict[str, Any], raw: str) -> dict[str, Any] | Cut:
    fw = firewall()
    return relay_body(Endpoint.CHAT, json.loads(raw), lambda: fw.open(INFO), raw=raw)


async def screened(
    body: dict[str, Any], raw: str, opened_in: list[int] | None = None
) -> dict[str, Any] | Cut:
    """``body`` screened as the flight screens it; ``opened_in`` gets the thread each guard was
    opened in."""
    fw = firewall()

    def open_guard() -> Any:
        if opened_in is not None:
            opened_in.append(threading.get_ident())
        return fw.open(INFO)

    opener = on_loop(open_guard)  # guards opened on the loop, as the flight's are
    return await off_loop(
        len(raw), lambda: relay_body(Endpoint.CHAT, json.loads(raw), opener, raw=raw)
    )


async def test_a_long_answer_is_screened_off_the_loop_with_the_same_result() -> None:
    look_alikes = ["CNRY", "-", "A", " "] * 160
    opened_in: list[int] = []
    for content in (f"here {OWN.text} it is", "plain", f"a leak {FOREIGN.text} here"):
        body, raw = answer(content, look_alikes)
        assert len(raw) >= OFF_LOOP_CHARS
        expected = screened_on_the_loop(body, raw)
        got = await screened(body, raw, opened_in)
        assert got == expected
        if FOREIGN.text in content:
            assert isinstance(got, Cut)
        else:
            assert isinstance(got, dict)
            assert OWN.text not in json.dumps(got)  # the own marker stripped, off the loop too
            tokens = got["choices"][0]["logprobs"]["content"]
            assert "".join(t["token"] for t in tokens).count("CNRY-A") == 0
    assert set(opened_in) == {threading.get_ident()}  # the firewall's tables: the loop's alone
    short, raw = answer(f"here {OWN.text}", ["CNRY"] * 8)
    assert len(raw) < OFF_LOOP_CHARS
    assert await screened(short, raw) == screened_on_the_loop(short, raw)


async def longest_gap(work: asyncio.Future[Any]) -> float:
    """The longest this loop went without running a 5 ms ticker while ``work`` ran."""
    loop = asyncio.get_running_loop()
    longest, last = 0.0, loop.time()
    while not work.done():
        await asyncio.sleep(0.005)
        now = loop.time()
        longest, last = max(longest, now - last), now
    return longest


async def test_the_loop_keeps_serving_while_a_long_answer_is_screened() -> None:
    body, raw = answer("ok", ["CNRY", "-", "A", " "] * 512)
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    inline = loop.create_future()  # the control: the same answer screened on the loop
    loop.call_soon(lambda: inline.set_result(screened_on_the_loop(body, raw)))
    stalled = await longest_gap(inline)
    on_loop_s = time.perf_counter() - started
    assert stalled >= 0.9 * on_loop_s  # on the loop, nothing else ran meanwhile

    started = time.perf_counter()
    work = asyncio.ensure_future(screened(body, raw))
    gap = await longest_gap(work)
    off_loop_s = time.perf_counter() - started
    assert work.result() == inline.result()
    assert gap < 0.25 * off_loop_s, (gap, off_loop_s, on_loop_s)
