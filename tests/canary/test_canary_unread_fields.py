"""Strings an engine sends outside the text its relay screens as text, which once reached the
client unread: another endpoint's text field, and a value hidden behind a duplicate JSON key."""

from __future__ import annotations

import json

import pytest
from firewall_in_process import CODEC, TENANTS, firewall

from canary.firewall import CanaryCut
from gateway.proxy.body import relay_body
from gateway.proxy.relay import StreamRelay
from gateway.upstream.base import Endpoint


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS])
def test_a_marker_in_another_endpoints_text_field_is_cut(endpoint: Endpoint) -> None:
    """Each endpoint's relay screens its own text (a chat choice's ``message.content`` or
    ``delta.content``, a completion's ``text``) as text; the text fields of the other shapes are
    side fields like any other string an engine sends. They used to be left out of the side
    screen whatever the endpoint, so a chat answer's ``choices[0].text`` (or a completion's
    ``message.content``) reached the client unscreened, a foreign marker in it included."""
    victim = CODEC.issue(TENANTS[8])
    fw, info = firewall()
    own = "text" if endpoint is Endpoint.COMPLETIONS else "message"
    for field, value in (
        ("text", victim.text),
        ("message", {"role": "assistant", "content": victim.text}),
        ("delta", {"content": victim.text}),
    ):
        if field == own:
            continue
        choice = {"index": 0, own: "ok" if own == "text" else {"content": "ok"}, field: value}
        body = {"id": "c1", "choices": [choice]}
        out = relay_body(endpoint, body, lambda: fw.open(info), raw=json.dumps(body))
        assert isinstance(out, CanaryCut), (endpoint, field)
    own = "text" if endpoint is Endpoint.COMPLETIONS else "delta"
    for field, value in (
        ("text", victim.text),
        ("message", {"content": victim.text}),
        ("delta", {"content": victim.text}),
    ):
        if field == own:
            continue
        stream = StreamRelay(endpoint=endpoint, open_guard=lambda: fw.open(info), wants_usage=False)
        choice = {"index": 0, own: "ok" if own == "text" else {"content": "ok"}, field: value}
        plain = {"id": "c1", "choices": [{"index": 0, own: choice[own]}]}
        for event in (plain, plain, {"id": "c1", "choices": [choice]}):  # after common chunks
            step = stream.on_event(f"data: {json.dumps(event)}\n\n".encode())
        assert victim.text not in b"".join(step.out).decode(), field
        assert isinstance(stream.cut, CanaryCut), field


def test_a_value_hidden_behind_a_duplicate_key_never_reaches_the_client() -> None:
    """JSON parsers keep the last of two values of one key, so the relay screens that one; an
    event's bytes went out as the engine sent them when its text passed unchanged, and with them
    the first value, never screened: a foreign marker there reached the client's socket. Now an
    event's own bytes go out only when they are exactly what the relay read (the JSON of the
    parsed event); anything else is written anew from what was screened."""
    victim = CODEC.issue(TENANTS[9])
    fw, info = firewall()
    stream = StreamRelay(endpoint=Endpoint.CHAT, open_guard=lambda: fw.open(info), wants_usage=True)
    plain = '{"id":"c1","choices":[{"index":0,"delta":{"content":"ok"}}]}'
    hidden = [
        '{"id":"c1","choices":[{"index":0,"delta":{"content":"%s","content":"ok"}}]}',
        '{"id":"c1","choices":[{"index":0,"delta":{"content":"ok"},"x":"%s","x":"y"}]}',
        '{"id":"c1","choices":[{"index":0,"delta":{"content":"ok"}}],"usage":{"u":"%s","u":1}}',
        '{"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"%s","finish_reason":"stop"}]}',
    ]
    out = b""
    for data in [plain, plain, *(h % victim.text for h in hidden)]:
        step = stream.on_event(f"data: {data}\n\n".encode())
        out += b"".join(step.out)
    assert victim.text not in out.decode() and victim.text[5:13] not in out.decode()
    assert stream.cut is None and json.loads(out.split(b"\n\n")[2][6:]) == json.loads(plain)
    assert out.startswith(f"data: {plain}\n\n".encode())  # the usual event goes out as it came
