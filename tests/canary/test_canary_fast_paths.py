"""The leak firewall's fast paths skip work, never a guarantee.

- ``FirewallGuard.skippable``: a side value the relay skips could change nothing -- a relay whose
  guards skip delivers exactly what a relay feeding every value delivers (the same bytes, the same
  cut, the same findings), for fields that are rewritten, cut-only fields read for the literal
  prefix once exposed, and their mix.
- ``StreamScanner.passes``: a chunk goes out unchanged only when nothing is held back or watched
  and it has no character a marker is made of, or when no candidate can start in it after the
  last characters delivered; a terminal scanner still refuses it.
- No side prefilter: any side string with a letter may continue a marker whose prefix was bent
  or lost, so the firewall states none (``GuardCapabilities``).
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import pytest

from canary.firewall import CanaryCut, FirewallGuard, LeakFirewall, TagIndex
from canary.folding import fold_flat
from canary.injection import MarkerLedger, RequestMarkers
from canary.markers import MarkerCodec, MarkerKeyring
from canary.scanner import ScannerStateError, StreamScanner
from contracts.plugins import Cut, Emit, RequestInfo, StreamGuard
from contracts.sse import SseSplitter
from gateway.proxy import relay as relay_module
from gateway.proxy.relay import StreamRelay
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


def test_the_firewall_states_no_side_prefilter() -> None:
    fw = LeakFirewall(CODEC, ledger=MarkerLedger(), tags=TagIndex(CODEC))
    assert fw.capabilities.screens_side and fw.capabilities.side_prefilter is None


class NeverSkips(StreamGuard):
    """The same guard, with no skipping: every value is fed (the reference)."""

    def __init__(self, guard: StreamGuard) -> None:
        self._guard = guard

    def feed(self, text: str) -> Emit | Cut:
        return self._guard.feed(text)

    def finish(self) -> Emit | Cut:
        return self._guard.finish()

    def exposed(self) -> Cut | None:
        return self._guard.exposed()

    def skippable(self, text: str) -> bool:
        return False


def owners_firewall() -> tuple[LeakFirewall, RequestInfo]:
    """The firewall with every tenant indexed, and the owner's request r1 (its own marker put)."""
    ledger = MarkerLedger()
    ledger.put("r1", RequestMarkers(own=frozenset({OWN.nonce})))
    tags = TagIndex(CODEC)
    tags.replace(TENANTS)
    fw = LeakFirewall(CODEC, ledger=ledger, tags=tags)
    info = RequestInfo("r1", OWNER, "m", "chat.completions", False, 0.0, engine="e1")
    return fw, info


def relay(raw: bytes, *, skips: bool) -> tuple[bytes, Cut | None]:
    fw, info = owners_firewall()
    stream = StreamRelay(
        endpoint=Endpoint.CHAT,
        open_guard=(lambda: fw.open(info)) if skips else (lambda: NeverSkips(fw.open(info))),
        wants_usage=False,
    )
    out = b""
    for event in SseSplitter().feed(raw):
        step = stream.on_event(event)
        out += b"".join(step.out)
        if step.end is not None:
            break
    return out, stream.cut


def _findings(cut: Cut | None) -> tuple[Any, ...]:
    """The findings without positions: a skipped value is not counted as delivered (the one
    thing ``skippable`` may change)."""
    findings = cut.findings if isinstance(cut, CanaryCut) else ()
    return tuple(replace(f, position=0) for f in findings)


def sse(events: list[dict[str, Any]], rng: random.Random) -> bytes:
    lines = [f"data: {escape_some_cs(json.dumps(e), rng)}\n\n" for e in events]
    return "".join([*lines, "data: [DONE]\n\n"]).encode()


def pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(1, 6)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize("field", ["id", "ext", "reasoning_content", "token"])
def test_a_relay_whose_guards_skip_delivers_what_feeding_every_value_delivers(field: str) -> None:
    rng = random.Random(field)
    cuts = 0
    for _ in range(150):
        secret = rng.choice(
            [
                VICTIM.text,
                OWN.text,
                "CNRY|" + OWN.text[5:],
                VICTIM.text[5:].lower(),
                "CNRY-" + VICTIM.text[5:20],
                "Cache",
            ]
        )
        parts = pieces(f"a {secret} b", rng)
        events = []
        for part in parts:
            content = rng.choice(["C", "x", "", " "])
            choice: dict[str, Any] = {"index": 0, "delta": {"content": content}}
            event: dict[str, Any] = {"id": "c1", "choices": [choice]}
            if field == "reasoning_content":
                choice["delta"][field] = part
            elif field == "token":
                choice["logprobs"] = {"content": [{"token": part, "bytes": list(part.encode())}]}
            else:
                event[field] = part
            events.append(event)
        raw = sse(events, rng)
        fast, fast_cut = relay(raw, skips=True)
        full, full_cut = relay(raw, skips=False)
        assert fast == full, raw
        assert _findings(fast_cut) == _findings(full_cut)
        assert (fast_cut and fast_cut.code) == (full_cut and full_cut.code)
        if secret == VICTIM.text:
            cuts += 1
            assert fast_cut is not None
    assert cuts > 15


def test_the_fast_paths_deliver_ordinary_text_as_feed_would() -> None:
    """``passes``: a chunk with nothing a marker is made of, nothing held or watched, or one in
    which, with the last characters delivered, no candidate can start (``feed``'s fast path) --
    delivered whole, the same as the full pass would; anything else is left to ``feed``."""
    scanner = StreamScanner(CODEC, owner_tenant_id=OWNER, own_nonces={OWN.nonce})
    assert scanner.passes("1, 8: 9.0!") and not scanner.watching
    assert scanner.passes("plain text") and scanner.watching  # read: the context moves on
    assert not scanner.passes("a C")  # a literal prefix may begin at its end
    assert scanner.feed("a C").text == "a " and scanner.held == 1
    assert not scanner.passes("xyz")  # something is held
    assert scanner.feed("xyz").text == "Cxyz" and scanner.held == 0
    assert not scanner.passes(OWN.text[5:20])  # the owner's tag: a candidate starts
    rng = random.Random(3)
    for _ in range(200):  # the same text through the fast path and through one full pass
        words = [
            rng.choice(["the", "Cache", "CN", "ok", OWN.text, OWN.text[5:20]]) for _ in range(12)
        ]
        text = " ".join(words)
        chunked = StreamScanner(CODEC, owner_tenant_id=OWNER, own_nonces={OWN.nonce})
        out = "".join(chunked.feed(text[i : i + 3]).text for i in range(0, len(text), 3))
        whole = StreamScanner(CODEC, owner_tenant_id=OWNER, own_nonces={OWN.nonce})
        delivered = fold_flat(out + chunked.finish().text)
        expected = fold_flat(whole.feed(text).text + whole.finish().text)
        # The same, but that a chunk may let out up to 7 characters of a bare copy before it is
        # recognised (never 8 of the marker in a row).
        assert delivered == expected or all(
            OWN.text[5 + i : 13 + i] not in delivered for i in range(25)
        ), text
    assert scanner.finish().text == ""
    with pytest.raises(ScannerStateError):
        scanner.passes("late")


def relay_memo(raw: bytes, *, memo: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[bytes, Any]:
    """``relay`` with the side screen's skeleton comparison and the guards' ``expose_whole`` on
    (the gateway) or off (every event walked and every value fed: the reference)."""
    with monkeypatch.context() as patch:
        if not memo:
            patch.setattr(relay_module, "skeleton", lambda obj, chat: None)
            patch.setattr(FirewallGuard, "expose_whole", lambda self, text: False)
        return relay(raw, skips=True)


@pytest.mark.parametrize("field", ["id", "model", "ext"])
def test_events_that_repeat_their_side_fields_are_screened_as_if_each_were_walked(
    field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An event whose fields but its text are the last quiet event's is not walked again: the
    stream's bytes, cut and findings are those of walking every event -- for a repeated value
    that is a marker, a piece of one, one whose repetition spells one (a rotation: v + v holds
    the marker), and for a value that changes to a marker after many quiet events."""
    rng = random.Random(field)
    cuts = 0
    for _ in range(120):
        marker = rng.choice([VICTIM.text, OWN.text, VICTIM.text[5:].lower()])
        turn = rng.randrange(1, len(marker))
        value = rng.choice(
            [
                marker,
                marker[turn:] + marker[:turn],  # a rotation: two in a row spell the marker
                marker[: rng.randint(3, 12)],
                "chatcmpl-" + "".join(rng.choice("abcCN0") for _ in range(8)),
                "Cache",
            ]
        )
        events = []
        switch = rng.randrange(2, 12)
        for i in range(14):
            content = rng.choice(["the", " C", "x", " Node", "CN"])
            event: dict[str, Any] = {"id": "c1", "object": "chat.completion.chunk"}
            event[field] = value if i < switch or rng.random() < 0.5 else marker
            event["choices"] = [{"index": 0, "delta": {"content": content}, "logprobs": None}]
            events.append(event)
        raw = sse(events, rng)
        fast, fast_cut = relay_memo(raw, memo=True, monkeypatch=monkeypatch)
        full, full_cut = relay_memo(raw, memo=False, monkeypatch=monkeypatch)
        assert fast == full, raw
        assert _findings(fast_cut) == _findings(full_cut)
        assert (fast_cut and fast_cut.code) == (full_cut and full_cut.code)
        cuts += fast_cut is not None
    assert cuts > 20


class Counting(NeverSkips):
    """The firewall's guard, skipping as it does, counting what is fed to it."""

    feeds = 0

    def feed(self, text: str) -> Emit | Cut:
        Counting.feeds += 1
        return super().feed(text)

    def skippable(self, text: str) -> bool:
        return self._guard.skippable(text)


def test_a_stream_that_repeats_its_side_fields_feeds_them_only_in_its_first_events() -> None:
    """The usual stream (vLLM's chunk: id, object, created, model, one choice with a text) costs
    its side guards a few feeds in its first two events (the second reads each field after the
    first one's last folded characters, and leaves them as they were), then one comparison per
    event; a cut-only field's guard whose scanner holds nothing stops counting as holding."""
    fw = LeakFirewall(CODEC, ledger=MarkerLedger(), tags=TagIndex(CODEC))
    info = RequestInfo("r1", OWNER, "m", "chat.completions", True, 0.0, engine="e1")
    stream = StreamRelay(
        endpoint=Endpoint.CHAT, open_guard=lambda: Counting(fw.open(info)), wants_usage=False
    )
    base = {"id": "chatcmpl-9fC3", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    words = ["The", " Cache", " node", " holds", " CN", " pages"] * 20
    Counting.feeds = 0
    for word in words:
        choice = {"index": 0, "delta": {"content": word}, "logprobs": None, "finish_reason": None}
        data = json.dumps({**base, "choices": [choice]})
        assert stream.on_event(f"data: {data}\n\n".encode()).end is None
    side = stream._side
    assert side is not None and not side.holding
    # the text guard is fed every event; the side guards only while the first events set them up
    assert len(words) <= Counting.feeds <= len(words) + 30


def test_the_tag_automaton_finds_the_windows_the_window_loop_finds() -> None:
    """``CandidateReader.quiet`` and the window starts of ``first`` (Aho-Corasick over the known
    tags, substring search for the request's own windows) are the plain definition: every
    8-character window that is a known tag or an own window, at every position."""
    from canary.candidates import ANCHOR, TAG_CHARS, CandidateReader

    tags = TagIndex(CODEC)
    tags.replace(TENANTS)
    reader = CandidateReader(
        CODEC,
        owner=OWNER,
        own_nonces=frozenset({OWN.nonce}),
        carried_nonces=frozenset(),
        known_tags=tags,
    )
    known, mine = tags.current.texts, reader._own_windows()
    words = [*known, *mine, ANCHOR, "ABCDEFGH", "Q2Z7", "X"]
    rng = random.Random(7)
    for _ in range(3000):
        chars = "".join(rng.choice(words)[rng.randrange(0, 4) :] for _ in range(rng.randint(0, 6)))
        windows = [
            i
            for i in range(len(chars) - TAG_CHARS + 1)
            if chars[i : i + TAG_CHARS] in known or chars[i : i + TAG_CHARS] in mine
        ]
        assert reader.quiet(chars) == (ANCHOR not in chars and not windows), chars
        start = rng.randint(0, max(0, len(chars) - TAG_CHARS))
        stop = rng.randint(start, max(start, len(chars) - TAG_CHARS + 1))
        expected = [i for i in windows if start <= i < stop]
        assert reader._window_starts(chars, start, stop) == expected, (chars, start, stop)


@pytest.mark.parametrize("field", ["id", "model", "ext", "name", "content"])
def test_a_whole_answer_whose_fields_pass_at_once_is_screened_as_if_each_were_fed(
    field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``relay_body``: a side field or a text of a non-streaming answer in which no candidate can
    start (``FirewallGuard.passes_whole``) is not fed to a scanner; the answer, its cut and
    findings are those of feeding every value and finishing (the reference: ``passes_whole``
    always False), own markers stripped alike."""
    from gateway.proxy.body import relay_body

    fw, info = owners_firewall()
    rng = random.Random(field)
    cuts = 0
    for _ in range(200):
        marker = rng.choice([VICTIM.text, OWN.text, VICTIM.text[5:].lower(), "CNRY-"])
        value = rng.choice(
            [
                marker,
                f"x {marker[: rng.randint(3, len(marker))]}",
                "chatcmpl-" + "".join(rng.choice("abcCNRY0-") for _ in range(12)),
                "plain words",
                "ends with CNR",
                "ünïcode " + marker[:9],
            ]
        )
        message: dict[str, Any] = {"role": "assistant", "content": "an answer"}
        body: dict[str, Any] = {"id": "c1", "choices": [{"index": 0, "message": message}]}
        if field in ("name", "content"):
            message[field] = value
        else:
            body[field] = value
        outcomes = []
        for whole in (True, False):
            with monkeypatch.context() as patch:
                if not whole:
                    patch.setattr(FirewallGuard, "passes_whole", lambda self, text: False)
                screened = relay_body(
                    Endpoint.CHAT, json.loads(json.dumps(body)), lambda: fw.open(info)
                )
            outcomes.append(
                (screened.code, _findings(screened)) if isinstance(screened, Cut) else screened
            )
        assert outcomes[0] == outcomes[1], body
        cuts += isinstance(outcomes[0], tuple)
    assert cuts > 20


def test_a_whole_answer_in_which_nothing_can_start_opens_one_guard(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``relay_body`` asks one guard first whether every string of a whole answer passes
    (``passes_each_whole`` of ``whole_texts``: each field key's strings joined, the text and the
    rewritable fields included): an ordinary answer opens that one guard, not one for its side
    fields and one per text. An answer where a candidate may start -- a marker whole in a field,
    split between two fields, two values of one field, the text and a field, two logprobs tokens,
    or a rewritable value that ends as the literal prefix begins -- goes the long way; its outcome
    is that of feeding every value (the reference: every fast check off)."""
    from gateway.proxy.body import relay_body

    fw, info = owners_firewall()
    opened: list[int] = []

    def open_guard() -> StreamGuard:
        opened.append(1)
        return fw.open(info)

    ordinary: dict[str, Any] = {
        "id": "chatcmpl-abc123",
        "object": "chat.completion",
        "model": "m",
        "system_fingerprint": "fp_1",
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": "an answer",
                    "refusal": None,
                    "reasoning_content": "a thought",
                },
                "logprobs": {
                    "content": [{"token": "an", "logprob": -0.1, "top_logprobs": []}],
                    "refusal": None,
                },
                "finish_reason": "stop",
            }
        ],
        "ext": ["one", "two"],
    }
    assert relay_body(Endpoint.CHAT, json.loads(json.dumps(ordinary)), open_guard) == ordinary
    assert len(opened) == 1
    rng = random.Random(7)
    cuts = changed = 0
    for _ in range(400):
        marker = rng.choice([VICTIM.text, OWN.text, VICTIM.text[5:].lower(), "CNRY-", "C", "CN"])
        cut = rng.randint(1, max(1, len(marker) - 1))
        head, tail = marker[:cut], marker[cut:]
        body = json.loads(json.dumps(ordinary))
        choice = body["choices"][0]
        where = rng.choice(
            ["one value", "two values", "two fields", "key", "text", "text and field",
             "reasoning", "tokens", "token ends", "none"]
        )  # fmt: skip
        if where == "one value":
            body["model"] = marker
        elif where == "two values":
            body["ext"] = [head, tail]
        elif where == "two fields":
            body["id"], body["model"] = head, tail
        elif where == "key":
            body["ext"] = {marker: 1}
        elif where == "text":
            choice["message"]["content"] = f"see {marker} here"
        elif where == "text and field":
            choice["message"]["content"], choice["finish_reason"] = head, tail
        elif where == "reasoning":
            choice["message"]["reasoning_content"] = marker
        elif where in ("tokens", "token ends"):
            tokens = [head, tail] if where == "tokens" else [marker, "x"]
            choice["logprobs"]["content"] = [
                {"token": t, "logprob": -0.1, "top_logprobs": []} for t in tokens
            ]
        outcomes = []
        for fast in (True, False):
            with monkeypatch.context() as patch:
                if not fast:
                    patch.setattr(FirewallGuard, "passes_whole", lambda self, text: False)
                    patch.setattr(FirewallGuard, "passes_each_whole", lambda self, texts: False)
                screened = relay_body(Endpoint.CHAT, json.loads(json.dumps(body)), open_guard)
            outcomes.append(
                (screened.code, _findings(screened)) if isinstance(screened, Cut) else screened
            )
        assert outcomes[0] == outcomes[1], body
        cuts += isinstance(outcomes[0], tuple)
        changed += not isinstance(outcomes[0], tuple) and outcomes[0] != body
    assert cuts > 40 and changed > 20


def test_a_marked_requests_windows_stay_with_its_reader() -> None:
    """The owner's tag texts (HMACs) are kept once per tenant for all of its requests; a marked
    request's own fragments are computed by its reader and go with it. They used to be kept in a
    module cache keyed by the request's nonces (1,024 entries, one per marked request): a
    long-lived heap each full garbage collection of the serving gateway walked."""
    from canary.candidates import CandidateReader, _owner_tags

    _owner_tags.cache_clear()
    for n in range(50):
        nonce = CODEC.issue(OWNER, nonce=b"req-%04d" % n).nonce
        reader = CandidateReader(
            CODEC,
            owner=OWNER,
            own_nonces=frozenset({nonce}),
            carried_nonces=frozenset(),
            known_tags=None,
        )
        assert not reader.quiet(CODEC.body_of(CODEC.tenant_tag(OWNER, key_id=2), 2, nonce)[1:9])
    assert _owner_tags.cache_info().currsize == 1
