"""The leak firewall's fast paths skip work, never a guarantee.

- ``LeakFirewall.side_prefilter``: an event it lets the relay skip has no ``C`` in any side
  string (whatever the escapes), and a relay using it delivers exactly what a relay that walks
  every event delivers -- the same bytes, the same cut, the same findings.
- ``StreamScanner.pass_through``: a chunk goes out unchanged only when nothing is held back and it
  has no ``C``; a terminal scanner still refuses it.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from canary.firewall import CanaryCut, LeakFirewall, TagIndex
from canary.injection import MarkerLedger, RequestMarkers
from canary.markers import MarkerCodec, MarkerKeyring
from canary.scanner import ScannerStateError, StreamScanner
from contracts.openai import choice_texts
from contracts.plugins import Cut, RequestInfo
from contracts.sse import SseSplitter
from gateway.proxy.relay import StreamRelay
from gateway.proxy.side import KEYS_PATH, rewrite_sites, side_fields
from gateway.upstream.base import Endpoint

CODEC = MarkerCodec(MarkerKeyring({1: bytes(range(32)), 2: bytes(range(40, 80))}, current=2))
TENANTS = [f"tn_{i:04d}" for i in range(20)]
OWNER = TENANTS[0]
OWN = CODEC.issue(OWNER, nonce=b"own-req1")
VICTIM = CODEC.issue(TENANTS[9], nonce=b"victim01")


def escape_some_cs(raw: str, rng: random.Random) -> str:
    """The same JSON value with some ``C``s spelled ``\\u0043`` (every ``C`` of a JSON text is
    inside a string, where that escape means the same character)."""
    return "".join("\\u0043" if c == "C" and rng.random() < 0.3 else c for c in raw)


def side_strings(obj: dict[str, Any]) -> list[str]:
    fields = side_fields(obj)
    return [v for values in fields.values() for v in values] + [
        value for _, _, value in rewrite_sites(obj)
    ]


def random_event(rng: random.Random) -> dict[str, Any]:
    def word() -> str:
        return rng.choice(["", "x", "C", "Cache", "abc", "CNRY-", VICTIM.text[:9], "ok"])

    choice: dict[str, Any] = {"index": 0, "finish_reason": rng.choice([None, "stop", "Cut"])}
    choice[rng.choice(["delta", "message"])] = {"content": word(), "reasoning_content": word()}
    if rng.random() < 0.3:
        choice["text"] = word()
    if rng.random() < 0.3:
        choice["logprobs"] = {"content": [{"token": word(), "bytes": [1]}]}
    event: dict[str, Any] = {"id": rng.choice(["c1", "Cmpl-1"]), "choices": [choice]}
    if rng.random() < 0.3:
        event[rng.choice(["ext", "Ext"])] = word()
    return event


def test_a_skipped_event_has_no_c_in_any_side_string() -> None:
    rng = random.Random(7)
    skipped = walked = skipped_with_c = 0
    for _ in range(3000):
        raw = json.dumps(random_event(rng), ensure_ascii=rng.random() < 0.5)
        raw = escape_some_cs(raw, rng)
        obj = json.loads(raw)
        if LeakFirewall.side_prefilter(raw, obj):
            walked += 1
            continue
        skipped += 1
        skipped_with_c += "C" in raw  # only the choice texts have one
        assert not any("C" in s for s in side_strings(obj)), raw
        assert "C" not in "".join(side_fields(obj)[KEYS_PATH])
    assert skipped > 100 and skipped_with_c > 50 and walked > 1000  # every outcome was exercised


def test_a_c_only_in_the_streamed_token_skips_the_walk_and_anything_else_does_not() -> None:
    def event(content: str, **extra: Any) -> dict[str, Any]:
        return {"id": "c1", "choices": [{"index": 0, "delta": {"content": content}}], **extra}

    skip = LeakFirewall.side_prefilter
    assert not skip(json.dumps(event("Cache C")), event("Cache C"))
    for obj in (event("C", ext="C"), event("C", Cx=1), event("C", ext="x\u0043")):
        assert skip(json.dumps(obj), obj)
    # The side field's only C is escaped: the raw text's one literal C is the token's.
    escaped = json.dumps(event("C", ext="C")).replace('"ext": "C"', '"ext": "\\u0043"')
    assert escaped.count("C") == 1 and skip(escaped, json.loads(escaped))
    assert list(choice_texts({"choices": [{"text": "a"}, "b", {"message": {"content": "c"}}]})) == [
        "a",
        "c",
    ]


def relay(raw: bytes, *, prefilter: bool) -> tuple[bytes, Cut | None]:
    ledger = MarkerLedger()
    ledger.put("r1", RequestMarkers(own=frozenset({OWN.nonce})))
    tags = TagIndex(CODEC)
    tags.replace(TENANTS)
    fw = LeakFirewall(CODEC, ledger=ledger, tags=tags)
    info = RequestInfo("r1", OWNER, "m", "chat.completions", False, 0.0, engine="e1")
    stream = StreamRelay(
        endpoint=Endpoint.CHAT,
        open_guard=lambda: fw.open(info),
        wants_usage=False,
        side_prefilter=fw.side_prefilter if prefilter else None,
    )
    out = b""
    for event in SseSplitter().feed(raw):
        step = stream.on_event(event)
        out += b"".join(step.out)
        if step.end is not None:
            break
    return out, stream.cut


def _findings(cut: Cut | None) -> tuple[Any, ...]:
    return cut.findings if isinstance(cut, CanaryCut) else ()


def sse(events: list[dict[str, Any]], rng: random.Random) -> bytes:
    lines = [f"data: {escape_some_cs(json.dumps(e), rng)}\n\n" for e in events]
    return "".join([*lines, "data: [DONE]\n\n"]).encode()


def pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, 6)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("field", ["id", "ext", "reasoning_content", "token"])
def test_the_relay_with_the_prefilter_delivers_what_a_full_walk_delivers(field: str) -> None:
    rng = random.Random(field)
    cuts = 0
    for _ in range(150):
        secret = rng.choice([VICTIM.text, OWN.text, "CNRY-" + VICTIM.text[5:20], "Cache"])
        parts = pieces(f"a {secret} b", rng)
        events = []
        for part in parts:
            choice: dict[str, Any] = {"index": 0, "delta": {"content": rng.choice(["C", "x"])}}
            event: dict[str, Any] = {"id": "c1", "choices": [choice]}
            if field == "reasoning_content":
                choice["delta"][field] = part
            elif field == "token":
                choice["logprobs"] = {"content": [{"token": part, "bytes": list(part.encode())}]}
            else:
                event[field] = part
            events.append(event)
        raw = sse(events, rng)
        fast, fast_cut = relay(raw, prefilter=True)
        full, full_cut = relay(raw, prefilter=False)
        assert fast == full, raw
        assert _findings(fast_cut) == _findings(full_cut)
        assert (fast_cut and fast_cut.code) == (full_cut and full_cut.code)
        if secret == VICTIM.text:
            cuts += 1
            assert fast_cut is not None and fast_cut.code == "isolation_violation"
    assert cuts > 20


def test_pass_through_only_when_nothing_is_held_and_no_c() -> None:
    scanner = StreamScanner(CODEC, owner_tenant_id=OWNER, own_nonces={OWN.nonce})
    assert scanner.pass_through("plain text")
    assert not scanner.pass_through("a C")  # may start a marker: must be scanned
    assert scanner.feed("a C").text == "a " and scanner.held == 1
    assert not scanner.pass_through("xyz")  # "C" is held: "xyz" decides it
    assert scanner.feed("xyz").text == "Cxyz" and scanner.held == 0
    assert scanner.pass_through(" more")
    assert scanner.finish().text == ""
    with pytest.raises(ScannerStateError):
        scanner.pass_through("late")
