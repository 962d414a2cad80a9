"""How long one tenant's request, or the answer it steers the model to write, holds the gateway's
event loop -- the loop every tenant's requests and streams share.

Run: ``python -m bench.bench_loop_stalls [--out PATH]`` (about a minute).

In process, the real functions, the median of 3 runs each, side by side with ordinary prose of
the same size (the ratio):

- request side: an 8 MiB body (the gateway's ``max_body_bytes``) through what the completion
  door does on the loop before the engine is called: the JSON parse (``gateway.proxy.door``),
  the OpenAI schema's validation (as the door runs it) and the canary's read of carried markers
  (``canary.injection.carried_markers``); a refusal ends the row where the gateway answers it;
- answer side: a whole (non-streamed) answer through the leak firewall as the flight screens it
  (``gateway.proxy.body.relay_body`` through ``off_loop``): the longest the loop went without
  running a 5 ms ticker meanwhile (an answer of ``OFF_LOOP_CHARS`` or more is screened in a
  worker thread), and the screen's own time.

The cases are the ones an audit found holding the loop for seconds (stop 47's note): a body of
``CNRY`` guesses, millions of content parts or JSON nodes, more distinct code points than the
old fold cache held (and ordinary Cyrillic after it), JSON nested 1,000 deep; answers of marker
look-alikes and of ``top_logprobs`` over look-alike tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from canary.firewall import LeakFirewall, TagIndex
from canary.injection import AnchorFlood, MarkerLedger, RequestMarkers, carried_markers
from canary.markers import MarkerCodec, MarkerKeyring
from contracts.openai import one_request, parser_checked_text
from contracts.plugins import RequestInfo
from gateway.openai.schemas import ChatCompletionBody
from gateway.proxy.body import off_loop, on_loop, relay_body
from gateway.proxy.door import _json
from gateway.upstream.base import Endpoint

RESULTS = Path(__file__).parent / "results" / "loop-stalls.md"
MAX_BODY = 8 * 1024 * 1024
CODEC = MarkerCodec(MarkerKeyring({1: bytes(range(32))}, current=1))
OWNER = "acme"
INFO = RequestInfo("r1", OWNER, "m", "chat.completions", False, 0.0, engine="e1")
HEAD = b'{"model":"m","messages":[{"role":"user","content":'
PROSE = "The quick brown fox jumps over the lazy dog. "


def _filled(head: bytes, unit: bytes, tail: bytes, sep: bytes = b"") -> bytes:
    count = (MAX_BODY - len(head) - len(tail)) // (len(unit) + len(sep))
    return head + sep.join([unit] * count) + tail


def _text(unit: str) -> bytes:
    return _filled(HEAD + b'"', unit.encode().replace(b'"', b""), b'"}]}')


def _distinct_non_bmp() -> bytes:
    count = (MAX_BODY - len(HEAD) - 8) // 4
    text = "".join(chr(0x10000 + (i * 7919) % 0x100000) for i in range(count))
    return HEAD + json.dumps(text, ensure_ascii=False).encode() + b"}]}"


def _nested(depth: int) -> bytes:
    inner = b"[" * depth + b"]" * depth
    return HEAD + b'"hi"}],"response_format":{"type":"json_schema","x":' + inner + b"}}"


REQUESTS: dict[str, Callable[[], bytes]] = {
    "ordinary prose (the baseline)": lambda: _text(PROSE),
    "`CNRY-` + 32 guessed characters, repeated": lambda: _text("CNRY-" + "A" * 32 + " "),
    "one text part per item of `content`": lambda: _filled(
        HEAD + b"[", b'{"type":"text","text":"a"}', b"]}]}", b","
    ),
    "`response_format` holding millions of numbers": lambda: _filled(
        HEAD + b'"hi"}],"response_format":{"type":"json_schema","x":[', b"0", b"]}}", b","
    ),
    "`response_format` holding millions of empty lists": lambda: _filled(
        HEAD + b'"hi"}],"response_format":{"type":"json_schema","x":[', b"[]", b"]}}", b","
    ),
    "more distinct non-BMP characters than the old fold cache held": _distinct_non_bmp,
    "Cyrillic prose (after the row above)": lambda: _text("Съешь же ещё этих мягких булок. "),
    "JSON nested 1,000 deep in `response_format`": lambda: _nested(1000),
}


def _door(raw: bytes) -> str:
    """What the door does on the loop with ``raw``, up to its answer or the engine call."""
    try:
        document, checked = _json(raw, "application/json")
        with one_request(), parser_checked_text() if checked else contextlib.nullcontext():
            ChatCompletionBody.model_validate(document)
    except ValueError:  # pydantic's ValidationError is one: the door's 400
        return "400 (schema)"
    try:
        carried_markers(CODEC, document, lambda tag: None)
    except AnchorFlood:
        return "400 too_many_canary_prefixes"
    return "to the engine"


def _median_ms(work: Callable[[], Any]) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(3):
        started = time.perf_counter()
        result = work()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times), result


def _firewall() -> LeakFirewall:
    ledger = MarkerLedger()
    ledger.put(INFO.request_id, RequestMarkers(own=frozenset({CODEC.issue(OWNER).nonce})))
    tags = TagIndex(CODEC)
    tags.replace([OWNER, "globex"])
    return LeakFirewall(CODEC, ledger=ledger, tags=tags)


def _answer(content: str, tokens: list[str]) -> dict[str, Any]:
    entries = [
        {
            "token": t,
            "logprob": -0.1,
            "bytes": list(t.encode()),
            "top_logprobs": [{"token": t, "logprob": -0.2, "bytes": list(t.encode())}] * 20,
        }
        for t in tokens
    ]
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": content}}
    choice |= {"finish_reason": "stop", "logprobs": {"content": entries} if entries else None}
    return {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice]}


ANSWERS: dict[str, Callable[[], dict[str, Any]]] = {
    "32 KiB of prose (the baseline)": lambda: _answer((PROSE * 800)[: 32 * 1024], []),
    "32 KiB of `CNRY-A ` (look-alikes to strip)": lambda: _answer("CNRY-A " * 4681, []),
    "12 KiB of `CNRY-A ` (screened on the loop)": lambda: _answer("CNRY-A " * 1755, []),
    "4,096 tokens, `top_logprobs` 20, of prose": lambda: _answer("ok", ["hello ", "world "] * 2048),
    "4,096 tokens, `top_logprobs` 20, spelling `CNRY-A `": lambda: _answer(
        "ok", ["CNRY", "-", "A", " "] * 1024
    ),
}


async def _answer_row(body: dict[str, Any]) -> tuple[float, float, int]:
    """The loop's longest gap while the flight screens ``body``, the screen's time, its size."""
    raw = json.dumps(body)
    parsed = json.loads(raw)  # as the engine client hands it over: parsed already
    firewall = _firewall()
    opener = on_loop(lambda: firewall.open(INFO))
    loop = asyncio.get_running_loop()
    started = time.perf_counter()
    work = asyncio.ensure_future(
        off_loop(len(raw), lambda: relay_body(Endpoint.CHAT, parsed, opener, raw=raw))
    )
    longest, last = 0.0, loop.time()
    while not work.done():
        await asyncio.sleep(0.005)
        now = loop.time()
        longest, last = max(longest, now - last), now
    work.result()
    return longest * 1000, (time.perf_counter() - started) * 1000, len(raw)


async def _answers() -> list[tuple[str, int, float, float]]:
    rows = []
    for name, build in ANSWERS.items():
        runs = [await _answer_row(build()) for _ in range(3)]
        gap = statistics.median(r[0] for r in runs)
        took = statistics.median(r[1] for r in runs)
        rows.append((name, runs[0][2], gap, took))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    lines = [
        "### How long one tenant holds the event loop",
        "",
        "`python -m bench.bench_loop_stalls`: in process, median of 3 runs (see the module).",
        "",
        "| request body (8 MiB) | on the loop | / prose | the gateway answers |",
        "|---|---|---|---|",
    ]
    base = None
    for name, build in REQUESTS.items():
        raw = build()
        ms, outcome = _median_ms(lambda raw=raw: _door(raw))
        base = base or ms
        lines.append(f"| {name} | {ms:.0f} ms | {ms / base:.1f}x | {outcome} |")
        print(lines[-1], file=sys.stderr, flush=True)
    lines += [
        "",
        "| whole answer | JSON size | the loop's longest gap | the screen took |",
        "|---|---|---|---|",
    ]
    for name, size, gap, took in asyncio.run(_answers()):
        lines.append(f"| {name} | {size // 1024} KiB | {gap:.0f} ms | {took:.0f} ms |")
        print(lines[-1], file=sys.stderr, flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
