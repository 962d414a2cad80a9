"""The leak firewall through the gateway's full response path, in process: upstream SSE bytes ->
``SseSplitter`` -> ``StreamRelay`` (per-choice and side guards) -> ``LeakFirewall`` guards ->
the bytes a client gets. Recall and false positives are measured on a corpus."""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Callable

import pytest
from firewall_in_process import CODEC, OWNER, TENANTS, firewall, new_relay

from canary.firewall import CanaryCut
from canary.folding import fold_flat
from canary.kinds import Evidence, FindingKind
from canary.markers import MarkerCodec, MarkerKeyring, decode_tag
from contracts.sse import SseSplitter
from gateway.lifecycle import Phase
from gateway.proxy.body import relay_body
from gateway.proxy.chunks import InvalidUpstream
from gateway.proxy.relay import KEEP_ALIVE, Step, StreamRelay
from gateway.upstream.base import Endpoint

OTHER_KEY = MarkerCodec(MarkerKeyring({2: bytes(range(1, 33))}, current=2))
B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"


def events(pieces: list[str], *, index: int = 0) -> bytes:
    out = b""
    for piece in pieces:
        chunk = {"id": "c1", "choices": [{"index": index, "delta": {"content": piece}}]}
        out += f"data: {json.dumps(chunk)}\n\n".encode()
    done = {"id": "c1", "choices": [{"index": index, "delta": {}, "finish_reason": "stop"}]}
    return out + f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n".encode()


def relay(raw: bytes, *, own: frozenset[bytes] = frozenset(), byte_chunk: int = 0):
    """(delivered text, cut or None, output bytes) for an upstream byte stream."""
    fw, info = firewall(own)
    stream = StreamRelay(
        endpoint=Endpoint.CHAT, open_guard=lambda: fw.open(info), wants_usage=False
    )
    splitter = SseSplitter()
    size = byte_chunk or len(raw)
    out = b""
    for start in range(0, len(raw), size):
        for event in splitter.feed(raw[start : start + size]):
            step = stream.on_event(event)
            out += b"".join(step.out)
            if step.end is not None:
                return _text(out), stream.cut, out
    return _text(out), stream.cut, out


def _text(out: bytes) -> str:
    parts = []
    for block in out.decode().split("\n\n"):
        if block.startswith("data: {"):
            for choice in json.loads(block[6:]).get("choices", []):
                parts.append((choice.get("delta") or {}).get("content") or "")
    return "".join(parts)


def split_at(text: str, points: list[int]) -> list[str]:
    points = sorted(set(p for p in points if 0 < p < len(text)))
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)]


def test_a_foreign_marker_split_at_every_offset_never_reaches_the_client() -> None:
    victim = CODEC.issue(TENANTS[7])
    text = f"The answer: {victim.text} end."
    at = text.index(victim.text)
    cases = [[s] for s in range(len(text) + 1)]
    cases += [[s, s + d] for s in range(at, at + 37) for d in (1, 5, 13)]
    cases.append(list(range(1, len(text))))
    for points in cases:
        delivered, cut, out = relay(events(split_at(text, points)))
        assert victim.text[:13] not in out.decode() and victim.text[5:13] not in out.decode()
        assert isinstance(cut, CanaryCut) and cut.code == "isolation_violation", points
        assert text.startswith(delivered) and len(delivered) <= at
        [finding] = cut.findings
        assert (finding.kind, finding.evidence, finding.victim_tenant) == (
            FindingKind.CROSS_TENANT,
            Evidence.CONFIRMED,
            TENANTS[7],
        )


@pytest.mark.parametrize("head", ["A", "Q" * 24])
def test_a_foreign_marker_behind_a_look_alike_head_is_cut_at_every_offset(head: str) -> None:
    """A leaking engine told to write a few characters between ``CNRY-`` and another tenant's
    marker: the look-alike's strip used to swallow the marker's tag and let the rest out, with
    no finding."""
    victim = CODEC.issue(TENANTS[7])
    text = f"The answer: CNRY-{head}{victim.text[5:]} end."
    at = text.index("CNRY-")
    for split in range(len(text) + 1):
        delivered, cut, out = relay(events(split_at(text, [split])))
        assert victim.text[5:13] not in out.decode() and victim.text[-8:] not in out.decode()
        assert isinstance(cut, CanaryCut) and cut.code == "isolation_violation", split
        assert text.startswith(delivered) and len(delivered) <= at, split
        [finding] = cut.findings
        assert (finding.kind, finding.evidence, finding.victim_tenant) == (
            FindingKind.CROSS_TENANT,
            Evidence.CONFIRMED,
            TENANTS[7],
        )


def test_own_markers_are_stripped_at_every_byte_chunking() -> None:
    own = CODEC.issue(OWNER)
    text = f"Echo: {own.text}. Done."
    for byte_chunk in (1, 2, 3, 7, 50, 0):
        delivered, cut, out = relay(
            events(split_at(text, [8, 20])), own=frozenset({own.nonce}), byte_chunk=byte_chunk
        )
        assert (delivered, cut) == ("Echo: . Done.", None)
        assert b"CNRY" not in out and out.endswith(b"data: [DONE]\n\n")


def test_each_choice_is_scanned_on_its_own() -> None:
    victim = CODEC.issue(TENANTS[3])
    half = 8  # "CNRY-" and 3 of the 8 tag characters: too little to name anyone
    # Choice 0 ends with the first part, choice 1 starts with the rest: no marker in either.
    raw = events(["plain text " + victim.text[:half]]).replace(b"data: [DONE]\n\n", b"")
    raw += events([victim.text[half:] + " more"], index=1)
    delivered, cut, _ = relay(raw)
    assert cut is None and delivered.endswith("more")
    # The whole marker in choice 1, in pieces, is caught.
    raw = events(["hello"]).replace(b"data: [DONE]\n\n", b"") + events(
        split_at(victim.text, [3, 9]), index=1
    )
    _, cut, out = relay(raw)
    assert isinstance(cut, CanaryCut) and victim.text not in out.decode()


def test_markers_outside_the_text_are_caught_per_field() -> None:
    victim = CODEC.issue(TENANTS[4])
    chunks = [victim.text[i : i + 5] for i in range(0, len(victim.text), 5)]
    raw = b""
    for piece in chunks:
        obj = {
            "id": "c",
            "choices": [
                {"index": 0, "delta": {"content": "x"}, "logprobs": {"content": [{"token": piece}]}}
            ],
        }
        raw += f"data: {json.dumps(obj)}\n\n".encode()
    _, cut, out = relay(raw)
    assert isinstance(cut, CanaryCut) and victim.text not in out.decode()
    keyed = {"id": "c", victim.text: 1, "choices": []}
    _, cut, _ = relay(f"data: {json.dumps(keyed)}\n\n".encode())
    assert isinstance(cut, CanaryCut)


# Where a side value sits in an event, and how to read it back from a delivered event. The
# cut-only fields (ids, extensions, list items, keys) go out as the engine sent them; the others
# are rewritten like the text.
SIDE_KINDS: dict[str, tuple[Callable[[str], dict], Callable[[dict], str]]] = {
    "id": (lambda v: {"id": v, "choices": []}, lambda o: o.get("id", "")),
    "system_fingerprint": (
        lambda v: {"system_fingerprint": v, "choices": []},
        lambda o: o.get("system_fingerprint", ""),
    ),
    "ext": (lambda v: {"id": "c", "ext": v}, lambda o: o.get("ext", "")),
    "nested_ext": (
        lambda v: {"choices": [{"index": 0, "delta": {}, "x_debug": {"hit": v}}]},
        lambda o: "".join(c.get("x_debug", {}).get("hit", "") for c in o.get("choices", [])),
    ),
    "list_item": (lambda v: {"debug": [v]}, lambda o: "".join(o.get("debug", []))),
    "key": (lambda v: {v: 1}, lambda o: "".join(o)),
    "reasoning": (
        lambda v: {"choices": [{"index": 0, "delta": {"reasoning_content": v}}]},
        lambda o: "".join(
            c.get("delta", {}).get("reasoning_content", "") for c in o.get("choices", [])
        ),
    ),
    "logprobs_token": (
        lambda v: {"choices": [{"index": 0, "delta": {}, "logprobs": {"content": [{"token": v}]}}]},
        lambda o: "".join(
            t["token"] for c in o.get("choices", []) for t in c["logprobs"]["content"]
        ),
    ),
}


def side_relay(
    kind: str, values: list[str], *, own: frozenset[bytes] = frozenset()
) -> tuple[str, StreamRelay, list[Step]]:
    """(the kind's values as delivered, concatenated; the relay; its steps) for one value per
    event (the stream ending with [DONE] unless cut)."""
    make, read = SIDE_KINDS[kind]
    stream = new_relay(own)
    steps, delivered = [], []
    for value in [*values, None]:
        raw = b"data: [DONE]\n\n" if value is None else f"data: {json.dumps(make(value))}\n\n"
        steps.append(step := stream.on_event(raw if isinstance(raw, bytes) else raw.encode()))
        for out in step.out:
            data = out.decode().removeprefix("data: ").strip()
            if data.startswith("{") and "error" not in json.loads(data):
                delivered.append(read(json.loads(data)))
        if step.end is not None:
            break
    return "".join(delivered), stream, steps


@pytest.mark.parametrize("kind", sorted(SIDE_KINDS))
@pytest.mark.parametrize("size", range(1, 9))
def test_a_marker_fed_a_few_characters_per_event_never_shows_a_tag(kind: str, size: int) -> None:
    """However a foreign marker is chunked into one side field, the client gets no more of it than
    ``CNRY-`` and 7 characters (cut-only fields, which go out as they are) or nothing at all
    (rewritten fields): never its tag, and the stream is cut as an isolation violation."""
    victim = CODEC.issue(TENANTS[9])
    pieces = [victim.text[i : i + size] for i in range(0, len(victim.text), size)]
    delivered, stream, steps = side_relay(kind, pieces)
    assert victim.text[:13] not in delivered and victim.text[5:13] not in delivered
    assert len(delivered) <= (12 if kind not in ("reasoning", "logprobs_token") else 0)
    assert (steps[-1].end, steps[-1].code) == (Phase.CUT, "isolation_violation")
    assert isinstance(stream.cut, CanaryCut)
    [finding] = stream.cut.findings
    assert (finding.kind, finding.victim_tenant) == (FindingKind.CROSS_TENANT, TENANTS[9])


@pytest.mark.parametrize("kind", sorted(SIDE_KINDS))
@pytest.mark.parametrize("first", ["hello", "msg_C", "c-n"])
@pytest.mark.parametrize("size", [3, 8, 32])
def test_a_bare_marker_after_an_ordinary_value_never_shows_a_tag(
    kind: str, first: str, size: int
) -> None:
    """A side field's guard kept reading folded text after the field's first value: a cut-only
    field's guard used to switch to the literal ``CNRY-`` alone once its first value passed (or
    what it held went out), so a marker written without its prefix in a later value of the same
    field -- an id, an extension field, a key -- reached the client whole."""
    victim = CODEC.issue(TENANTS[9])
    body = victim.text[5:]
    pieces = [body[i : i + size] for i in range(0, len(body), size)]
    delivered, stream, steps = side_relay(kind, [first, *pieces])
    assert body[:8] not in delivered and len(delivered) <= len(first) + 7
    assert (steps[-1].end, steps[-1].code) == (Phase.CUT, "isolation_violation")
    assert isinstance(stream.cut, CanaryCut)


def test_side_fields_pass_what_cannot_name_a_tenant() -> None:
    victim = CODEC.issue(TENANTS[9])
    # Ids ending in a marker's first characters, and a fragment shorter than a tag, go out.
    for values in (["chatcmpl-ABC", "chatcmpl-ABC"], ["x CNRY", "-", victim.text[5:12], "!"]):
        delivered, stream, steps = side_relay("id", values)
        assert (delivered, stream.cut, steps[-1].end) == ("".join(values), None, Phase.COMPLETED)
    # A look-alike showing a tag nobody has, undecided at the end of an event, may still grow
    # into a marker the index cannot name: the stream ends before it goes out, with no finding.
    look_alike = "CNRY-" + "A" * 8
    assert CODEC.tag_index(TENANTS).get(decode_tag("A" * 8)) is None
    delivered, stream, steps = side_relay("ext", ["CNRY-AAAA", look_alike[9:]])
    assert delivered == "CNRY-AAAA" and not isinstance(stream.cut, CanaryCut)
    assert (steps[-1].end, steps[-1].code) == (Phase.CUT, "upstream_error")
    assert b"does not belong" not in b"".join(steps[-1].out)
    # A separator does not end it (a marker may be spaced out): still undecided when the event
    # goes out, so the same upstream error; with less than a tag shown it goes out.
    delivered, stream, steps = side_relay("ext", [look_alike + "!"])
    assert (steps[-1].end, steps[-1].code) == (Phase.CUT, "upstream_error")
    assert not isinstance(stream.cut, CanaryCut)
    delivered, stream, steps = side_relay("ext", ["CNRY-AAAAAAA!"])
    assert (delivered, stream.cut) == ("CNRY-AAAAAAA!", None)
    # Spread over events, the request's own marker stops where anyone's would: after ``CNRY-``
    # and 7 characters, as an undecided upstream error -- whether characters match the owner's
    # tag or marker changes nothing the tenant sees (no oracle); so does another request's of
    # the same tenant. Whole in one value of a field that cannot be rewritten it goes out as the
    # engine sent it (a limit the canary README states).
    own, other = CODEC.issue(OWNER), CODEC.issue(OWNER)
    for marker in (own, other):
        pieces = [marker.text[i : i + 6] for i in range(0, 37, 6)]
        delivered, stream, steps = side_relay("id", pieces, own=frozenset({own.nonce}))
        assert delivered == marker.text[:12] and steps[-1].code == "upstream_error"
        assert not isinstance(stream.cut, CanaryCut)
    delivered, stream, steps = side_relay("id", [own.text], own=frozenset({own.nonce}))
    if own.text.endswith(("C", "CN", "CNR")):  # may begin a later marker: held, so undecided
        assert steps[-1].code == "upstream_error" and not isinstance(stream.cut, CanaryCut)
    else:
        assert (delivered, stream.cut) == (own.text, None)


def test_a_marker_cut_short_by_the_engine_still_yields_its_finding() -> None:
    """A stream that ends without [DONE] delivers nothing more, but its guards are finished: a
    foreign marker truncated by an engine crash is a finding, the stream ends cut."""
    victim = CODEC.issue(TENANTS[11])
    for visible in (8, 23, 31):
        for where in ("text", "reasoning"):
            stream = new_relay()
            text = "Hi " + victim.text[: 5 + visible]
            delta = {"content": text} if where == "text" else {"reasoning_content": text}
            obj = {"id": "c", "choices": [{"index": 0, "delta": delta}]}
            out = b"".join(stream.on_event(f"data: {json.dumps(obj)}\n\n".encode()).out)
            end = stream.on_upstream_end()
            out += b"".join(end.out)
            assert victim.text[:8] not in out.decode()
            assert (end.end, end.code) == (Phase.CUT, "isolation_violation")
            [finding] = stream.cut.findings
            assert (finding.evidence, finding.victim_tenant) == (Evidence.SUSPECTED, TENANTS[11])
            assert (finding.victim_nonce == victim.nonce) is (visible >= 23)
    # Nothing held: the usual upstream error.
    stream = new_relay()
    stream.on_event(events(["plain"]).split(b"\n\n")[0] + b"\n\n")
    end = stream.on_upstream_end()
    assert (end.end, end.code, stream.cut) == (Phase.FAILED, "upstream_error", None)


def test_events_the_gateway_cannot_vouch_for_end_the_stream() -> None:
    deep = b"data: " + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"\n\n"
    late = events(["a"]).replace(b"data: [DONE]\n\n", b"") + events(["b"])
    many = {"choices": [{"index": i, "delta": {"content": "x"}} for i in range(17)]}
    for raw in (deep, late, f"data: {json.dumps(many)}\n\n".encode(), b"data: [1,2]\n\n"):
        stream = new_relay()
        ends = [step for e in SseSplitter().feed(raw) if (step := stream.on_event(e)).end]
        assert (ends[0].end, ends[0].code) == (Phase.FAILED, "upstream_error"), raw
    fw, info = firewall()
    stream = StreamRelay(
        endpoint=Endpoint.CHAT, open_guard=lambda: fw.open(info), wants_usage=False
    )
    victim = CODEC.issue(TENANTS[5])
    assert stream.on_event(f": {victim.text}\n\n".encode()).out == [KEEP_ALIVE]
    body = {"choices": [{"index": i, "message": {"content": "x"}} for i in range(17)]}
    try:
        relay_body(Endpoint.CHAT, body, lambda: fw.open(info))
    except InvalidUpstream:
        pass
    else:
        raise AssertionError("17 choices accepted")


def test_non_streaming_bodies_are_screened_per_choice_and_field() -> None:
    victim = CODEC.issue(TENANTS[6])
    own = CODEC.issue(OWNER)
    fw, info = firewall(frozenset({own.nonce}))
    clean = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": f"a {own.text} b"}}]
    }
    out = relay_body(Endpoint.CHAT, clean, lambda: fw.open(info))
    assert out["choices"][0]["message"]["content"] == "a  b"
    for leaky in (
        {
            "choices": [
                {"index": 0, "message": {"content": "ok"}},
                {"index": 1, "message": {"content": victim.text}},
            ]
        },
        {
            "choices": [{"index": 0, "message": {"content": "ok"}}],
            "debug": [victim.text[:10], victim.text[10:]],
        },
    ):
        assert isinstance(relay_body(Endpoint.CHAT, leaky, lambda: fw.open(info)), CanaryCut)


def test_non_streaming_side_fields_are_all_screened() -> None:
    """No prefilter: any side string with a letter may continue a marker whose prefix was bent or
    lost, so every side field is screened (with the text, all in one check of one guard,
    ``passes_each_whole``, when no candidate can start in any); a marker in one, plain, bent or
    ``\u0043``-escaped, is cut."""
    victim = CODEC.issue(TENANTS[7])
    fw, info = firewall()
    assert fw.capabilities.side_prefilter is None
    opened: list[int] = []

    def open_guard():
        opened.append(1)
        return fw.open(info)

    def screen_raw(body: dict, raw: str | None = None) -> object:
        opened.clear()
        raw = json.dumps(body) if raw is None else raw
        return relay_body(Endpoint.CHAT, body, open_guard, side_prefilter=None, raw=raw)

    clean = {"id": "cmpl-1", "choices": [{"index": 0, "message": {"content": "Cats"}}]}
    assert screen_raw(clean) == clean
    assert len(opened) == 1  # one guard asked of every string at once
    for debug in (victim.text, victim.text[5:].lower(), "CNRY|" + victim.text[5:]):
        assert isinstance(screen_raw({**clean, "debug": debug}), CanaryCut), debug
    escaped = json.dumps({**clean, "debug": victim.text}).replace("C", "\\u0043")
    assert isinstance(screen_raw(json.loads(escaped), escaped), CanaryCut)


# -- the corpus ------------------------------------------------------------------------------------

WORDS = ["the", "Cache", "of", "CNRX", "and", "Context", "CN", "CNR", "CNRY", "copy", "Node"]
WORDS += ["request", "tenant", "C", "window", "page"]


def prose(rng: random.Random, n_chars: int) -> str:
    words = []
    size = 0
    while size < n_chars:
        word = (
            rng.choice(WORDS)
            if rng.random() < 0.9
            else "".join(rng.choices(string.ascii_letters, k=5))
        )
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


CANDIDATE = re.compile("CNRY-[A-Z2-7]{1,32}")


def look_alikes(rng: random.Random) -> list[str]:
    """Text that resembles a marker but is nobody's: no finding, no cut."""
    return [
        "CNRY-" + "".join(rng.choices(B32, k=32)),  # well-formed, MAC invalid, a tag nobody has
        "CNRX-" + "".join(rng.choices(B32, k=32)),  # another prefix, a body nobody's
        ("cnry-" + "".join(rng.choices(B32, k=32))).lower(),  # bent, a body nobody's
        OTHER_KEY.issue(rng.choice(TENANTS)).text,  # genuine under a key we do not hold
        "CNRY-" + "".join(rng.choices(B32, k=7)),  # too short to name anyone
    ]


def bent(rng: random.Random, marker: str) -> str:
    """A genuine marker as a model may be made to write it: no candidate for the corpus's
    look-alikes, a leak to cut."""
    body = marker[5:]
    return rng.choice(
        [
            marker,
            "CNRX-" + body,
            marker.lower(),
            "CNRY " + body,
            "CNRY-" + body[:7] + "-" + body[7:],
            "CNRY- " + body,
            "CNRY|" + body,
            body,
        ]
    )


def chunked(rng: random.Random, text: str) -> list[str]:
    points = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, len(text) // 12)))
    return split_at(text, points)


def test_corpus_recall_and_false_positives() -> None:
    rng = random.Random(20260917)
    caught = leaked = 0
    for _ in range(150):
        victim = CODEC.issue(rng.choice(TENANTS[1:]))
        damaged = rng.random() < 0.3
        shown = victim.text[: rng.randint(13, 36)] if damaged else bent(rng, victim.text)
        text = (
            prose(rng, rng.randint(0, 400))
            + " "
            + shown
            + (" " if damaged else "")
            + prose(rng, 200)
        )
        leaked += 1
        _, cut, out = relay(events(chunked(rng, text)), byte_chunk=rng.choice((0, 1, 7, 64)))
        caught += (
            isinstance(cut, CanaryCut)
            and shown not in out.decode()
            and victim.text[5:13] not in fold_flat(out.decode())
        )
    flagged = clean_chars = 0
    for _ in range(80):
        parts = []
        for _ in range(20):
            parts.append(prose(rng, rng.randint(50, 400)))
            parts.append(rng.choice(look_alikes(rng)))
        text = " ".join(parts)
        delivered, cut, _ = relay(events(chunked(rng, text)))
        # A literal candidate that is no genuine marker goes, whoever's characters it shows (no
        # oracle); bent look-alikes of nobody's marker are ordinary text.
        flagged += cut is not None or delivered != CANDIDATE.sub("", text)
        clean_chars += len(text)
    print(f"recall {caught}/{leaked}; false positives {flagged}/80 responses ({clean_chars} chars)")
    assert (caught, leaked) == (150, 150)
    assert flagged == 0 and clean_chars > 400_000
