"""Stream scanner: a marker is recognised by its tag, nonce and MAC, whatever a model did to its
form (issue 32, finding 1: a ``logit_bias`` against ``-`` made the bundled model write
``CNRY|<body>``, whose MAC verified, and the firewall delivered it).

Every form here is one a model can be made to write -- by a ``logit_bias``, by an instruction, by
its own sampling -- and each is checked at every chunk split.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator

import pytest

from canary.folding import MAX_GAP, fold_flat
from canary.kinds import Evidence, FindingKind
from canary.markers import TAG_CHARS, MarkerCodec, MarkerKeyring, encode_tag
from canary.scanner import MAX_HOLDBACK, UNDECIDED, Finding, ScannerState, StreamScanner

CODEC = MarkerCodec(MarkerKeyring({1: bytes(range(32)), 2: bytes(range(100, 140))}, current=2))
OWNER = "acme"
OWN = CODEC.issue(OWNER, nonce=b"own-req1")
OTHER_REQUEST = CODEC.issue(OWNER, nonce=b"own-req2")
FOREIGN = CODEC.issue("globex", nonce=b"foreign1")
INDEX = CODEC.known_tags([OWNER, "globex", "initech"])

FORMS: dict[str, Callable[[str], str]] = {
    "logit_bias against '-'": lambda m: "CNRY|" + m[5:],
    "no separator": lambda m: "CNRY" + m[5:],
    "lowercase": str.lower,
    "mixed case": lambda m: "".join(c.lower() if i % 2 else c for i, c in enumerate(m)),
    "spaced": " ".join,
    "grouped": lambda m: m[:5] + "-".join(m[i : i + 4] for i in range(5, 37, 4)),
    "one line each 8": lambda m: m[:5] + "\n".join(m[i : i + 8] for i in range(5, 37, 8)),
    "zero-width": "\u200b".join,
    "full-width": lambda m: "".join(chr(0xFF00 + ord(c) - 0x20) if c != "-" else c for c in m),
    "bare body": lambda m: m[5:],
    "other prefix": lambda m: "REF:" + m[5:],
    "digits between": lambda m: "0".join(m),
}
LEAD = {"other prefix": "REF:"}  # ordinary text before the body in a form
ANCHORED = {"logit_bias against '-'", "no separator", "lowercase", "mixed case", "spaced"}
ANCHORED |= {"grouped", "one line each 8", "zero-width", "full-width", "digits between"}


def scanner(own: Iterable[bytes] = (OWN.nonce,)) -> StreamScanner:
    return StreamScanner(CODEC, owner_tenant_id=OWNER, own_nonces=set(own), known_tags=INDEX)


def scan(chunks: Iterable[str], **kwargs: object) -> tuple[str, list[Finding], bool, int]:
    """(delivered, findings, cut, redactions)."""
    s = scanner(**kwargs)  # type: ignore[arg-type]
    parts: list[str] = []
    findings: list[Finding] = []
    for chunk in chunks:
        result = s.feed(chunk)
        assert s.held <= MAX_HOLDBACK
        parts.append(result.text)
        findings.extend(result.findings)
        if result.cut:
            return "".join(parts), findings, True, s.redactions
    result = s.finish()
    return "".join(parts) + result.text, findings + list(result.findings), result.cut, s.redactions


def splits(text: str) -> Iterator[list[str]]:
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)


def genuine_in(text: str) -> bool:
    """Whether any 32 consecutive folded characters of ``text`` are a genuine marker body."""
    folded = fold_flat(text)
    return any(CODEC.verify_body(folded[i : i + 32]) for i in range(len(folded) - 31))


def shares_a_window(text: str, body: str) -> bool:
    """Whether ``text`` (folded) holds 8 consecutive characters of ``body``."""
    folded = fold_flat(text)
    return any(body[i : i + 8] in folded for i in range(len(body) - 7))


def extra(delivered: str, expected: str) -> int:
    """How many more marker characters ``delivered`` shows than ``expected``."""
    return len(fold_flat(delivered)) - len(fold_flat(expected))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_own_marker_in_any_form_is_stripped_at_every_split(form: str) -> None:
    bent = FORMS[form](OWN.text)
    text = "Echo: " + bent + " done."
    for chunks in splits(text):
        delivered, findings, cut, redactions = scan(chunks)
        assert (findings, cut, redactions) == ([], False, 1), chunks
        assert not genuine_in(delivered) and not shares_a_window(delivered, OWN.text[5:])
        # Before a candidate is recognised at most 7 of its characters may have gone out (a
        # bent prefix, or the start of a bare body): never a whole tag.
        assert 0 <= extra(delivered, f"Echo: {LEAD.get(form, '')} done.") <= UNDECIDED, chunks
    if form in ANCHORED:  # seen at once, a bent prefix goes with the marker
        assert scan([text])[0] == "Echo:  done."


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_foreign_marker_in_any_form_is_cut_before_it_shows_a_tag(form: str) -> None:
    bent = FORMS[form](FOREIGN.text)
    text = "Answer: " + bent + " and the rest"
    for chunks in splits(text):
        delivered, [finding], cut, _ = scan(chunks)
        assert cut and finding.evidence is Evidence.CONFIRMED, chunks
        assert (finding.kind, finding.victim_tenant) == (FindingKind.CROSS_TENANT, "globex")
        lead = "Answer: " + LEAD.get(form, "")
        assert delivered.startswith("Answer: ") and extra(delivered, lead) <= UNDECIDED, chunks
        assert FOREIGN.text[5:13] not in fold_flat(delivered)
    # Seen at once, nothing of it goes out, its prefix neither.
    assert scan([text])[0] == "Answer: " + LEAD.get(form, "")


def test_another_request_of_the_same_tenant_bent_is_cross_request() -> None:
    delivered, [finding], cut, _ = scan(
        ["x " + FORMS["logit_bias against '-'"](OTHER_REQUEST.text)]
    )
    assert (delivered, cut, finding.kind, finding.victim_tenant) == (
        "x ",
        True,
        FindingKind.CROSS_REQUEST,
        OWNER,
    )


def test_a_carried_marker_bent_is_delivered_as_sent() -> None:
    s = StreamScanner(
        CODEC,
        owner_tenant_id=OWNER,
        own_nonces=set(),
        carried_nonces={OWN.nonce},
        known_tags=INDEX,
    )
    text = "echo " + FORMS["lowercase"](OWN.text) + " ok"
    result = s.feed(text)
    assert result.text + s.finish().text == text and s.redactions == 0


@pytest.mark.parametrize("changed", [1, 2, 3, 5])
def test_an_own_marker_with_characters_changed_loses_every_8_it_shares(changed: int) -> None:
    """A copy bent character by character (a forbidden letter, sampling noise) keeps no run of 8
    characters of the own marker: each is stripped (the own-fragment rule)."""
    rng = random.Random(changed)
    for _ in range(40):
        body = list(OWN.text[5:])
        for at in rng.sample(range(32), changed):
            body[at] = "A" if body[at] != "A" else "B"
        for copy in ("".join(body), "CNRY|" + "".join(body), " ".join(body).lower()):
            delivered, findings, cut, _ = scan(["The code: " + copy + ". Bye"])
            assert (findings, cut) == ([], False)
            assert not shares_a_window(delivered, OWN.text[5:]), (copy, delivered)


def test_no_partial_oracle_for_the_owners_tag_without_the_prefix() -> None:
    """Up to 7 characters of the owner's tag are treated exactly as any other characters: the same
    holding, the same delivery. Only the whole tag (40 bits, which nobody guesses) is stripped."""
    own_tag = encode_tag(CODEC.tenant_tag(OWNER))
    nobody = "".join("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"[(ord(c) * 7) % 32] for c in own_tag)
    assert nobody not in INDEX and nobody != own_tag
    for k in range(1, TAG_CHARS):
        seen = []
        for guess in (own_tag[:k], nobody[:k]):
            s = scanner()
            text = f"see {guess} ok"
            steps = [(len(s.feed(ch).text), s.held) for ch in text]
            delivered = text[: sum(n for n, _ in steps)] + s.finish().text
            seen.append((steps, delivered == text, s.redactions))
        assert seen[0] == seen[1], k
    whole = scan([f"see {own_tag}JJJJJJJJJJJJJJJJJJJJJJJJ ok"])
    assert whole[3] == 1 and own_tag not in whole[0]
    assert scan([f"see {nobody}JJJJ ok"])[:3] == (f"see {nobody}JJJJ ok", [], False)


def test_without_an_anchor_a_foreign_tag_must_not_contradict_its_key_id() -> None:
    """8 characters that are a tenant's tag, in ordinary text, cut only when the 2 after them show
    that tag's key id too (48 bits: ordinary text cannot do it by chance); after any form of the
    prefix, or at the end of the copy, the tag alone does."""
    body = FOREIGN.text[5:]
    right = body[:10] + "JJJJ"
    wrong_key = body[:8] + ("AA" if body[8:10] != "AA" else "BB") + "JJJJ"
    assert scan(["x " + right + " y"])[2]
    assert scan(["x " + wrong_key + " y"])[:3] == ("x " + wrong_key + " y", [], False)
    assert scan(["x cnry " + wrong_key + " y"])[2]
    assert scan(["x " + body[:8]])[2]  # the copy ends after the tag


def test_every_strip_counts_one_whatever_was_stripped() -> None:
    damaged = OWN.text[:20] + ("A" if OWN.text[20] != "A" else "B") + OWN.text[21:]
    for text in (OWN.text, damaged, "CNRY-AAAA", FORMS["spaced"](OWN.text), OWN.text[5:30]):
        assert scan(["a " + text + " b"])[3] == 1, text
    assert scan(["a " + OWN.text + " b " + OWN.text.lower()])[3] == 2
    assert scan(["nothing to see here"])[3] == 0


def test_a_gap_longer_than_the_limit_ends_a_run() -> None:
    """The stated limit: characters more than MAX_GAP separators apart are not one marker."""
    spread = (" " * (MAX_GAP + 1)).join(OWN.text[5:])
    assert scan([spread])[:3] == (spread, [], False)
    close = (" " * MAX_GAP).join(OWN.text[5:])
    assert scan([close])[:4] == ("", [], False, 1)


def test_expose_lets_out_a_bent_candidate_only_while_it_shows_less_than_a_tag() -> None:
    def exposed(text: str) -> tuple[ScannerState, list[Finding] | None]:
        s = scanner()
        s.feed("x " + text)
        result = s.expose()
        return s.state, None if result is None else list(result.findings)

    bent = FORMS["logit_bias against '-'"](FOREIGN.text)
    assert exposed(bent[:12]) == (ScannerState.OPEN, None)  # CNRY| and 7: no tag yet
    state, [finding] = exposed(bent[:13])  # type: ignore[misc]
    assert state is ScannerState.CUT and finding.evidence is Evidence.SUSPECTED
    assert exposed(FORMS["logit_bias against '-'"](OWN.text)[:20]) == (ScannerState.CUT, [])


def test_the_quick_foldings_agree_with_the_folding_of_each_character() -> None:
    """``fold_ascii``, ``fold_flat`` and ``has_marker_characters`` (byte tables) read every ASCII
    character as ``fold`` does (the characters with positions): a marker character in any case
    becomes the upper-case one, any other character is dropped."""
    from canary.folding import fold, fold_ascii, has_marker_characters

    every = "".join(map(chr, range(128)))
    assert fold_ascii(every) == "234567ABCDEFGHIJKLMNOPQRSTUVWXYZABCDEFGHIJKLMNOPQRSTUVWXYZ"
    rng = random.Random(11)
    alphabet = every + "ＣＮＲＹ２é—\u200b"
    for _ in range(500):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
        assert fold_flat(text) == fold(text).chars, repr(text)
        assert has_marker_characters(text) == bool(fold(text).chars), repr(text)
        if text.isascii():
            assert fold_ascii(text) == fold(text).chars, repr(text)
