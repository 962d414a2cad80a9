"""What a streamed Responses event costs the gateway's machines, beside chat's relay (issue 29).

Run: ``python -m bench.bench_responses_events [--events N] [--rounds R]``

In one process, side by side on the same answer (``--events`` text tokens, vLLM's chunk and event
shapes, the real leak firewall guarding every stream, one request's worth of guards per round):

- ``parse only``: ``json.loads`` of each chat chunk's data (the floor every path pays);
- ``chat relay``: today's chat path per event (``gateway.proxy.relay.StreamRelay.on_event``);
- ``chat -> Responses``: each chat chunk parsed and fed to ``ChatToResponses`` (the translation
  for engines without ``/v1/responses``), which writes the Responses events;
- ``native Responses``: each vLLM 0.33.0 Responses event through ``NativeStream.on_event``
  (parsed, screened, rebuilt, re-stamped).

CPU per upstream event (``time.process_time``), the median over rounds, and the ratio to the chat
relay. Pure CPU work, no I/O: the HTTP cost comes with the routes (``bench.bench_relay``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from canary.firewall import LeakFirewall, TagIndex
from canary.injection import MarkerLedger, RequestMarkers
from canary.markers import MarkerCodec, MarkerKeyring
from contracts.plugins import RequestInfo
from contracts.sse import SseSplitter
from gateway.proxy.relay import StreamRelay
from gateway.responses.chat_stream import ChatToResponses
from gateway.responses.native import NativeStream
from gateway.responses.objects import envelope, new_id
from gateway.responses.schemas import CreateResponseBody
from gateway.upstream.base import Endpoint

OUT = Path(__file__).parent / "results" / "responses_events.md"
WORDS = ["The", " Cat", " sat", " on", " the", " mat", ".", " Calm"]


def _firewall() -> Callable[[], object]:
    codec = MarkerCodec(MarkerKeyring({1: bytes(range(32))}, current=1))
    ledger = MarkerLedger()
    ledger.put("r1", RequestMarkers(own=frozenset({codec.issue("tn_a").nonce})))
    tags = TagIndex(codec)
    tags.replace([f"tn_{i}" for i in range(64)])
    info = RequestInfo("r1", "tn_a", "m", "responses", False, 0.0, engine="e")
    fw = LeakFirewall(codec, ledger=ledger, tags=tags)
    return lambda: fw.open(info)


def _chat_events(n: int) -> list[bytes]:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    chunks = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
    for i in range(n):
        delta = {"content": WORDS[i % len(WORDS)]}
        chunks.append({**head, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    chunks.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    usage = {"prompt_tokens": 9, "completion_tokens": n, "total_tokens": 9 + n}
    chunks.append({**head, "choices": [], "usage": usage})
    return [f"data: {json.dumps(c)}\n\n".encode() for c in chunks] + [b"data: [DONE]\n\n"]


def _native_events(n: int) -> list[bytes]:
    where = {"item_id": "msg_" + "a" * 32, "output_index": 0, "content_index": 0}
    item = {"id": where["item_id"], "type": "message", "role": "assistant", "status": "completed"}
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    text = "".join(WORDS[i % len(WORDS)] for i in range(n))
    done = {**part, "text": text}
    objs = [
        {"type": "response.created", "response": {}},
        {"type": "response.in_progress", "response": {}},
        {"type": "response.output_item.added", "output_index": 0, "item": {**item, "content": []}},
        {"type": "response.content_part.added", **where, "part": part},
        *(
            {"type": "response.output_text.delta", **where, "delta": WORDS[i % len(WORDS)],
             "logprobs": []}
            for i in range(n)
        ),
        {"type": "response.output_text.done", **where, "text": text, "logprobs": []},
        {"type": "response.content_part.done", **where, "part": done},
        {"type": "response.output_item.done", "output_index": 0,
         "item": {**item, "content": [done]}},
        {"type": "response.completed", "response": {"status": "completed", "output": [
            {**item, "content": [done]}], "usage": {"input_tokens": 9, "output_tokens": n}}},
    ]  # fmt: skip
    return [
        f"event: {o['type']}\ndata: {json.dumps({**o, 'sequence_number': i})}\n\n".encode()
        for i, o in enumerate(objs)
    ]


def _env():  # type: ignore[no-untyped-def]
    body = CreateResponseBody.model_validate({"model": "m", "input": "hi", "stream": True})
    return envelope(body, response_id=new_id("resp"), created_at=1, max_output_tokens=64)


def run_parse(events: list[bytes], open_guard: Callable[[], object]) -> None:
    for raw in events:
        data = raw[6:].strip()
        if data != b"[DONE]":
            json.loads(data)


def run_chat_relay(events: list[bytes], open_guard: Callable[[], object]) -> None:
    relay = StreamRelay(
        endpoint=Endpoint.CHAT,
        open_guard=open_guard,  # type: ignore[arg-type]
        wants_usage=False,
    )
    for raw in events:
        relay.on_event(raw)


def run_translate(events: list[bytes], open_guard: Callable[[], object]) -> None:
    machine = ChatToResponses(_env(), open_guard)  # type: ignore[arg-type]
    machine.start()
    for raw in events:
        data = raw[6:].strip()
        if data == b"[DONE]":
            machine.done()
        else:
            machine.feed(json.loads(data))


def run_native(events: list[bytes], open_guard: Callable[[], object]) -> None:
    machine = NativeStream(_env(), open_guard)  # type: ignore[arg-type]
    for raw in SseSplitter().feed(b"".join(events)):
        machine.on_event(raw)


def measure(run: Callable[..., None], events: list[bytes], rounds: int, repeat: int) -> float:
    """Median CPU µs per upstream event over ``rounds`` (each ``repeat`` answers)."""
    samples = []
    for _ in range(rounds):
        start = time.process_time()
        for _ in range(repeat):
            run(events, _firewall())
        samples.append((time.process_time() - start) / (repeat * len(events)) * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=256, help="text tokens per answer")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=20, help="answers per round")
    args = parser.parse_args()
    chat, native = _chat_events(args.events), _native_events(args.events)
    rows = [
        ("parse only", measure(run_parse, chat, args.rounds, args.repeat)),
        ("chat relay", measure(run_chat_relay, chat, args.rounds, args.repeat)),
        ("chat -> Responses", measure(run_translate, chat, args.rounds, args.repeat)),
        ("native Responses", measure(run_native, native, args.rounds, args.repeat)),
    ]
    relay = rows[1][1]
    lines = [
        f"CPU per upstream event, {args.events}-token answers, median of {args.rounds} rounds "
        f"(`python -m bench.bench_responses_events --events {args.events} --rounds {args.rounds}`)",
        "",
        "| path | µs per event | × chat relay |",
        "|---|---|---|",
        *(f"| {name} | {cost:.2f} | {cost / relay:.2f} |" for name, cost in rows),
    ]
    table = "\n".join(lines) + "\n"
    print(table, end="")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(table, encoding="utf-8")


if __name__ == "__main__":
    main()
