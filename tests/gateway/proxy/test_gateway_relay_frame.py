"""``gateway.proxy.frame``: a stream's usual token, relayed without parsing it, changes nothing
the client gets.

The relay keeps the bytes of its last common chunk around the text; a later event made of the
same bytes around a plain JSON string goes out once its guard passes the text. The tests drive
two relays over the same events, one free to use the frame and one made to read every event in
full (its frame dropped before each event), with the leak firewall's guards, and require the same
bytes, the same ending and the same counts after every event: on streams mixing plain tokens
with tokens that need escapes, non-ASCII text, foreign markers split across tokens, role and
finish chunks, usage, keep-alives, an extra field that changes, a repeated key, a
non-canonical event and text after a finished choice.
"""

from __future__ import annotations

import json
import random
from typing import Any

import orjson
import pytest

from canary.firewall import LeakFirewall, TagIndex
from canary.injection import MarkerLedger, RequestMarkers
from canary.markers import MarkerCodec, MarkerKeyring
from contracts.plugins import PassThroughGuard, RequestInfo
from gateway.proxy import relay as relay_module
from gateway.proxy.frame import Frame
from gateway.proxy.relay import StreamRelay
from gateway.upstream.base import Endpoint

CODEC = MarkerCodec(MarkerKeyring({1: bytes(range(32))}, current=1))
TENANTS = [f"tn_{i:04d}" for i in range(20)]
ENVELOPE = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": "kvguard-tiny",
}


def _relay() -> StreamRelay:
    ledger = MarkerLedger()
    ledger.put("r1", RequestMarkers())
    tags = TagIndex(CODEC)
    tags.replace(TENANTS)
    info = RequestInfo("r1", TENANTS[0], "m", "chat.completions", False, 0.0, engine="e1")
    firewall = LeakFirewall(CODEC, ledger=ledger, tags=tags)
    return StreamRelay(
        endpoint=Endpoint.CHAT, open_guard=lambda: firewall.open(info), wants_usage=True
    )


def _event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def _chunk(
    text: str | None, *, finish: str | None = None, role: str | None = None, **extra: Any
) -> bytes:
    delta: dict[str, Any] = {} if role is None else {"role": role}
    if text is not None:
        delta["content"] = text
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return _event({**ENVELOPE, **extra, "choices": [choice]})


def _texts(rng: random.Random) -> list[str]:
    marker = CODEC.issue(TENANTS[3]).text  # another tenant's: the firewall must cut it
    cut = rng.randrange(1, len(marker) - 1)
    return [
        " the",
        " gateway",
        " relays",
        "\n",
        ' "quoted"',
        " back\\slash",
        " tab\tbed",
        " café",
        " 数据",
        " 🚀",
        "\u2028",
        "CN",
        "RY",
        marker[:cut],
        marker[cut:],
        " " + marker,
    ]


def _stream(rng: random.Random) -> list[bytes]:
    texts = _texts(rng)
    events = [_chunk("", role="assistant")] if rng.random() < 0.5 else []
    for _ in range(rng.randrange(4, 30)):
        roll = rng.random()
        if roll < 0.75:
            events.append(
                _chunk(rng.choice(texts[:11]) if rng.random() < 0.9 else rng.choice(texts))
            )
        elif roll < 0.80:
            events.append(b": keep-alive\n\n")
        elif roll < 0.85:
            events.append(_chunk(rng.choice(texts), system_fingerprint=f"fp{rng.randrange(3)}"))
        elif roll < 0.88:  # a repeated key: the first value must never reach the client unread
            body = orjson.dumps({**ENVELOPE, "choices": [{"index": 0, "delta": {"content": "x"}}]})
            events.append(b'data: {"id":"evil",' + body[1:] + b"\n\n")
        elif roll < 0.91:  # not canonical: spaces after the separators
            choice = {"index": 0, "delta": {"content": rng.choice(texts)}, "finish_reason": None}
            events.append(b"data: " + _spaced({**ENVELOPE, "choices": [choice]}) + b"\n\n")
        elif roll < 0.95:
            events.append(_chunk(None, finish="stop"))  # then any text is text after the finish
        else:
            usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
            events.append(_event({**ENVELOPE, "choices": [], "usage": usage}))
    events.append(b"data: [DONE]\n\n")
    return events


def _spaced(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode()


def _state(relay: StreamRelay) -> tuple[Any, ...]:
    return (relay.end, relay.end_code, relay.text_events, relay.saw_text, relay.cut is None)


@pytest.mark.parametrize("seed", range(60))
def test_a_stream_relayed_through_the_frame_is_the_stream_read_in_full(seed: int) -> None:
    rng = random.Random(seed)
    events = _stream(rng)
    framed, full = _relay(), _relay()
    framed_out: list[bytes] = []
    full_out: list[bytes] = []
    for event in events:
        ended = framed.relay_event(event, framed_out)
        full._frame = None  # read every event in full
        assert ended == full.relay_event(event, full_out), event
        assert framed_out == full_out, event
        assert _state(framed) == _state(full), event
        if ended:
            break


def test_the_usual_token_is_relayed_without_being_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    relay = _relay()
    out: list[bytes] = []
    relay.relay_event(_chunk(""), out)
    relay.relay_event(_chunk(" the"), out)
    assert relay._frame is not None

    def unparsed(*_: Any) -> Any:
        raise AssertionError("the usual token was parsed")

    monkeypatch.setattr(relay_module.orjson, "loads", unparsed)
    for text in (" gateway", " relays", " every"):
        relay.relay_event(_chunk(text), out)
    assert out[-3:] == [_chunk(" gateway"), _chunk(" relays"), _chunk(" every")]
    assert relay.text_events == 4


def test_a_frame_is_not_made_when_the_text_and_its_key_appear_twice() -> None:
    raw = _chunk(" same", note={"content": " same"})
    assert Frame.of(raw, " same", chat=True, guard=PassThroughGuard()) is None
    assert Frame.of(_chunk(" same"), " same", chat=True, guard=PassThroughGuard()) is not None


@pytest.mark.parametrize(
    "literal",
    [
        b'"say \\"stop\\""',  # an escaped quote
        b'"a\\u0041"',  # any escape
        b'"line\nbreak"',  # a raw control character (not JSON)
        b'"\xff\xfe"',  # not UTF-8
        b'""',  # no text: the common chunk needs one
        b'"open',  # not one literal
        b'"a","finish_reason":"stop"',  # a literal and more
    ],
)
def test_only_a_plain_string_literal_fills_a_frame(literal: bytes) -> None:
    frame = Frame.of(_chunk(" x"), " x", chat=True, guard=PassThroughGuard())
    assert frame is not None
    assert frame.head + b'" x"' + frame.tail == _chunk(" x")  # the chunk, cut around its text
    assert frame.text_of(frame.head + literal + frame.tail) is None
    assert frame.text_of(frame.head + b'" y"' + frame.tail) == " y"
    assert frame.text_of(_chunk(" y", system_fingerprint="fp")) is None  # other bytes around it
