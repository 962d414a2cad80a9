"""Stream scanner: exact behaviour for each kind of marker, at every chunk split."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace

import pytest

from canary.candidates import UNDECIDED, FixedTags, TagSet
from canary.folding import fold_flat
from canary.kinds import Evidence, FindingKind
from canary.markers import NONCE_CHARS, Marker, MarkerCodec, MarkerKeyring, encode_tag
from canary.scanner import (
    MAX_HOLDBACK,
    TERMINAL,
    TRANSITIONS,
    Finding,
    KnownTags,
    ScannerState,
    ScannerStateError,
    StreamScanner,
)

KEY_1 = bytes(range(32))
KEY_2 = bytes(range(100, 140))
CODEC = MarkerCodec(MarkerKeyring({1: KEY_1, 2: KEY_2}, current=2))
OLD_CODEC = MarkerCodec(MarkerKeyring({1: KEY_1}, current=1))
OWNER = "acme"
OWN = CODEC.issue(OWNER, nonce=b"own-req1")
OWN_OLD_KEY = OLD_CODEC.issue(OWNER, nonce=b"own-req0")
OTHER_REQUEST = CODEC.issue(OWNER, nonce=b"own-req2")
FOREIGN = CODEC.issue("globex", nonce=b"foreign1")
STRANGER = CODEC.issue("stranger", nonce=b"strange1")  # a real tenant missing from the index
INDEX = CODEC.known_tags([OWNER, "globex", "initech"])
CANDIDATES = re.compile(r"(?=(CNRY-[A-Z2-7]{32}))")


@dataclass
class Outcome:
    text: str
    findings: list[Finding]
    cut: bool
    max_held: int


def scan(
    chunks: Iterable[str],
    *,
    own: Sequence[bytes] = (OWN.nonce, OWN_OLD_KEY.nonce),
    known: KnownTags | None = INDEX,
) -> Outcome:
    scanner = StreamScanner(CODEC, owner_tenant_id=OWNER, own_nonces=set(own), known_tags=known)
    parts: list[str] = []
    findings: list[Finding] = []
    max_held = 0
    for chunk in chunks:
        result = scanner.feed(chunk)
        max_held = max(max_held, scanner.held)
        parts.append(result.text)
        findings.extend(result.findings)
        if result.cut:
            assert scanner.state is ScannerState.CUT
            return Outcome("".join(parts), findings, True, max_held)
    result = scanner.finish()
    parts.append(result.text)
    findings.extend(result.findings)
    return Outcome("".join(parts), findings, result.cut, max_held)


def seen(outcome: Outcome) -> tuple[str, list[Finding], bool]:
    return outcome.text, outcome.findings, outcome.cut


def splits(text: str, *, three_way: bool = True) -> Iterator[list[str]]:
    """Every 2-way split, every 3-way split (when asked) and one char per chunk."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
        if three_way:
            for j in range(i, len(text) + 1):
                yield [text[:i], text[i:j], text[j:]]
    yield list(text)


def genuine_markers_in(text: str) -> list[str]:
    return [m for m in CANDIDATES.findall(text) if CODEC.verify(m) is not None]


def confirmed(marker: Marker, kind: FindingKind, victim: str | None, at: int) -> Finding:
    return Finding(
        kind=kind,
        evidence=Evidence.CONFIRMED,
        position=at,
        victim_tag=marker.tenant_tag,
        victim_tenant=victim,
        key_id=marker.key_id,
        victim_nonce=marker.nonce,
    )


def suspected(marker: Marker, victim: str, at: int, *, visible: int = 0) -> Finding:
    """A damaged copy's finding; with ``visible`` >= 23 body characters it carries the nonce."""
    shows = visible >= NONCE_CHARS
    return Finding(
        kind=FindingKind.CROSS_TENANT,
        evidence=Evidence.SUSPECTED,
        position=at,
        victim_tag=marker.tenant_tag,
        victim_tenant=victim,
        key_id=marker.key_id if shows else None,
        victim_nonce=marker.nonce if shows else None,
    )


def own_ending_with(suffix: str) -> Marker:
    """A genuine own marker whose last characters are ``suffix`` (found by trying nonces)."""
    for i in range(1_000_000):
        marker = CODEC.issue(OWNER, nonce=i.to_bytes(8, "big"))
        if marker.text.endswith(suffix):
            return marker
    raise AssertionError(f"no own marker ends with {suffix!r}")


def test_fixture_tags_do_not_share_a_first_character() -> None:
    # Several tests rely on foreign fragments not being a prefix of one of the owner's tags.
    owner_firsts = {encode_tag(t)[0] for t in CODEC.tenant_tags(OWNER)}
    assert FOREIGN.text[5] not in owner_firsts and STRANGER.text[5] not in owner_firsts
    assert "A" not in owner_firsts and "Q" not in owner_firsts


def test_plain_text_passes_through_unchanged_at_every_split() -> None:
    text = "The quick brown fox, CNRX- and cnry-, jumps. Co-NRY CN RY C-N"
    for chunks in splits(text, three_way=False):
        assert seen(scan(chunks)) == (text, [], False)


@pytest.mark.parametrize(
    ("chunk", "delivered", "held", "total"),
    [
        # Ordinary text goes out at once; a literal prefix begun at the end is held.
        ("hello world", "hello world", 0, "hello world"),
        ("abc C", "abc ", 1, "abc C"),
        ("xCN", "x", 2, "xCN"),
        ("xCNRY", "x", 4, "xCNRY"),
        ("cnry", "cnry", 0, "cnry"),  # a bent prefix is recognised with what follows it
        # A look-alike after the literal prefix is held until decided, then stripped like any
        # damaged candidate after it, whatever its characters: no oracle for the owner's tag.
        ("x CNRY-" + "A" * 31, "x ", 36, "x "),
        ("CNRY-AAAAA ", "", 11, " "),
        ("CNRY-" + "A" * 32 + " ok" + "," * 9, " ok" + "," * 9, 0, " ok" + "," * 9),
        ("CNRY-" + "A" * 28 + "CNRY", "", 37, ""),  # its tail may start a marker
        ("CNRY- ok", "", 8, "CNRY- ok"),  # no base32 character right after: it shows nothing
        ("cnry-aaaa", "", 9, "cnry-aaaa"),  # a bent one: held until its body shows a tag
    ],
)
def test_holds_back_only_what_could_still_become_a_marker(
    chunk: str, delivered: str, held: int, total: str
) -> None:
    scanner = StreamScanner(CODEC, owner_tenant_id=OWNER, own_nonces=set(), known_tags=INDEX)
    assert scanner.feed(chunk).text == delivered
    assert scanner.held == held <= MAX_HOLDBACK
    rest = scanner.finish()
    assert (delivered + rest.text, rest.findings, rest.cut) == (total, (), False)


def test_foreign_marker_at_every_split_is_cut_before_its_first_character() -> None:
    text = "Answer: " + FOREIGN.text + " and the rest"
    want = [confirmed(FOREIGN, FindingKind.CROSS_TENANT, "globex", 8)]
    for chunks in splits(text):
        got = scan(chunks)
        assert seen(got) == ("Answer: ", want, True), chunks
        assert got.max_held <= MAX_HOLDBACK


def test_own_marker_is_stripped_at_every_split() -> None:
    for marker in (OWN, OWN_OLD_KEY):  # the old key id still counts as the tenant's own
        text = "Echo: " + marker.text + " done."
        for chunks in splits(text):
            assert seen(scan(chunks)) == ("Echo:  done.", [], False), chunks


def test_a_strip_is_judged_on_the_text_as_received() -> None:
    # No filler is put where a marker was: the text around it is read again as the tenant
    # receives it, so it cannot assemble a marker there (see the assembling tests below).
    assert scan(["ABC" + OWN.text + "DEF"]).text == "ABCDEF"
    assert scan(["abc" + OWN.text + "def"]).text == "abcdef"


def test_marker_of_another_request_of_the_same_tenant_is_cross_request() -> None:
    text = "x" + OTHER_REQUEST.text
    want = [confirmed(OTHER_REQUEST, FindingKind.CROSS_REQUEST, OWNER, 1)]
    for chunks in splits(text, three_way=False):
        assert seen(scan(chunks)) == ("x", want, True)


def test_own_nonce_does_not_make_another_tenants_marker_own() -> None:
    copied_nonce = CODEC.issue("globex", nonce=OWN.nonce)
    got = scan([copied_nonce.text])
    assert got.findings == [confirmed(copied_nonce, FindingKind.CROSS_TENANT, "globex", 0)]


def test_genuine_marker_of_an_unindexed_tenant_is_confirmed_without_a_name() -> None:
    for known in (INDEX, None):
        got = scan(["hi " + STRANGER.text], known=known)
        assert got.findings == [confirmed(STRANGER, FindingKind.CROSS_TENANT, None, 3)]
        assert got.findings[0].victim_tag == CODEC.tenant_tag("stranger")
        assert (got.text, got.cut) == ("hi ", True)


def test_known_tags_may_be_a_live_index_read_as_it_is_at_each_chunk() -> None:
    live = FixedTags({})
    scanner = StreamScanner(CODEC, owner_tenant_id=OWNER, own_nonces=set(), known_tags=live)
    assert scanner.feed("a ").text == "a "
    live.current = TagSet.of(INDEX)  # the index is replaced while the stream runs
    got = scanner.feed(FOREIGN.text)
    assert list(got.findings) == [confirmed(FOREIGN, FindingKind.CROSS_TENANT, "globex", 2)]


def test_position_counts_the_text_the_tenant_received() -> None:
    got = scan([OWN.text + "abc", "de" + FOREIGN.text])
    assert got.text == "abcde"
    assert got.findings[0].position == 5


@pytest.mark.parametrize("visible", range(32))
def test_truncated_foreign_marker_is_suspected_only_with_its_whole_tag(visible: int) -> None:
    text = "Hi " + FOREIGN.text[: 5 + visible]
    for chunks in splits(text, three_way=False):
        if visible >= 8:
            want = [suspected(FOREIGN, "globex", 3, visible=visible)]
            assert seen(scan(chunks)) == ("Hi ", want, True)
        elif visible > 0:  # less than a tag: stripped like any look-alike, no finding
            assert seen(scan(chunks)) == ("Hi ", [], False)
        else:
            assert seen(scan(chunks)) == (text, [], False)


@pytest.mark.parametrize("visible", [0, 7, 8, 20, 31])
def test_truncated_or_broken_markers_are_never_flagged_without_known_tags(visible: int) -> None:
    """Without known tags nothing names a victim: stripped (a look-alike), never a finding."""
    head = FOREIGN.text[: 5 + visible]
    shown = head if visible == 0 else ""
    for text, want in (("Hi " + head, "Hi " + shown), (head + ". ok", shown + ". ok")):
        assert seen(scan([text], known=None)) == (want, [], False)


@pytest.mark.parametrize("visible", [0, 5, 7, 8, 9, 20, 31])
def test_foreign_marker_broken_mid_stream(visible: int) -> None:
    head, rest = FOREIGN.text[: 5 + visible], FOREIGN.text[5 + visible :]
    text = "Hi " + head + " tail" + rest
    got = scan([text])
    if visible == 0:  # the bare body after " tail" is the marker itself: cut there
        want = [confirmed(FOREIGN, FindingKind.CROSS_TENANT, "globex", len("Hi CNRY- tail"))]
        assert seen(got) == ("Hi CNRY- tail", want, True)
    elif visible >= 8:  # the tag shows: a damaged copy (the nonce read from what follows)
        [found] = got.findings
        assert (got.text, got.cut) == ("Hi ", True)
        assert replace(found, key_id=None, victim_nonce=None) == suspected(FOREIGN, "globex", 3)
    else:  # the fragment is stripped; the rest names nobody without its tag: plain text
        assert seen(got) == ("Hi  tail" + rest, [], False)


def test_damaged_copy_of_a_foreign_marker_is_suspected_by_its_tag() -> None:
    body = FOREIGN.text[5:]
    for i in range(8, 32):  # every character after the tag
        alt = "A" if body[i] != "A" else "B"
        damaged = "CNRY-" + body[:i] + alt + body[i + 1 :]
        text, [found], cut = seen(scan(["> " + damaged + " <"]))
        assert (text, cut) == ("> ", True)
        # Key id and nonce come from the damaged copy: exact only when the damage is after them.
        unread = replace(found, key_id=None, victim_nonce=None)
        assert unread == suspected(FOREIGN, "globex", 2)
        if i >= NONCE_CHARS:
            assert (found.key_id, found.victim_nonce) == (FOREIGN.key_id, FOREIGN.nonce)
        else:
            assert found.victim_nonce != FOREIGN.nonce
    for i in range(8):  # a damaged tag names no one: a look-alike, stripped without a finding
        alt = "A" if body[i] != "A" else "B"
        damaged = "CNRY-" + body[:i] + alt + body[i + 1 :]
        assert seen(scan(["> " + damaged + " <"])) == (">  <", [], False)


@pytest.mark.parametrize("visible", [1, 7, 8, 20, 31])
def test_truncated_or_damaged_own_and_same_tenant_markers_are_stripped(visible: int) -> None:
    for marker in (OWN, OTHER_REQUEST):
        for chunks in splits("Hi " + marker.text[: 5 + visible], three_way=False):
            assert seen(scan(chunks)) == ("Hi ", [], False)
        assert scan(["Hi " + marker.text[: 5 + visible] + "; ok"]).text == "Hi ; ok"
    body = OWN.text[5:]
    damaged = "CNRY-" + body[:20] + ("A" if body[20] != "A" else "B") + body[21:]
    assert seen(scan(["Hi " + damaged + " ok"])) == ("Hi  ok", [], False)


def test_marker_hidden_in_the_tail_of_a_look_alike_is_found() -> None:
    look_alike_head = "CNRY-" + "A" * 28  # + "CNRY" from the genuine marker = 32 characters
    text = "<" + look_alike_head + FOREIGN.text + ">"
    want = [confirmed(FOREIGN, FindingKind.CROSS_TENANT, "globex", 1)]  # the head is stripped
    for chunks in splits(text):
        assert seen(scan(chunks)) == ("<", want, True)


# A leaking engine told to write a few characters between ``CNRY-`` and another tenant's marker:
# the literal look-alike's run (``CNRY-`` and up to 32 base32 characters) reaches into the
# marker, whose tag stands whole inside it. The tag decides, never the look-alike's strip.
LOOK_ALIKE_HEADS = ["A", "Q" * 24, "Q" * 31]


@pytest.mark.parametrize("head", LOOK_ALIKE_HEADS)
def test_a_marker_behind_a_look_alike_head_is_cut_at_every_split(head: str) -> None:
    text = "ctx CNRY-" + head + FOREIGN.text[5:] + " end"
    want = [confirmed(FOREIGN, FindingKind.CROSS_TENANT, "globex", 4)]
    for chunks in splits(text, three_way=False):
        got = scan(chunks)
        assert seen(got) == ("ctx ", want, True), chunks
        assert got.max_held <= MAX_HOLDBACK


@pytest.mark.parametrize("head", LOOK_ALIKE_HEADS)
def test_a_damaged_copy_behind_a_look_alike_head_is_suspected_at_every_split(head: str) -> None:
    body = FOREIGN.text[5:]
    tag_only = body[:8]  # what follows (" end") contradicts its key id: the prefix decides
    bad_mac = body[:-1] + ("A" if body[-1] != "A" else "B")
    for copy, visible in ((tag_only, 0), (bad_mac, 32)):
        text = "ctx CNRY-" + head + copy + " end"
        want = [suspected(FOREIGN, "globex", 4, visible=visible)]
        for chunks in splits(text, three_way=False):
            assert seen(scan(chunks)) == ("ctx ", want, True), chunks


@pytest.mark.parametrize("prefix", ["", "cnry-", "CNRY|"])
@pytest.mark.parametrize("pad", ["", "Q" * 16, "Q" * 23])
def test_a_marker_behind_the_owners_tag_is_cut_at_every_split(prefix: str, pad: str) -> None:
    # A damaged copy showing the owner's tag is stripped 32 characters long; a leaking engine
    # that copies the owner's tag from its own marker must not hide another tenant's in them.
    text = "ctx " + prefix + OWN.text[5:13] + pad + FOREIGN.text[5:] + " end"
    want = confirmed(FOREIGN, FindingKind.CROSS_TENANT, "globex", 4)
    for chunks in splits(text, three_way=False):
        got = scan(chunks)
        # Split before it is recognised, at most 7 folded characters of a copy written without
        # the literal prefix went out (the context), never the owner's whole tag.
        assert got.cut and text.startswith(got.text), chunks
        assert len(fold_flat(got.text[len("ctx ") :])) <= UNDECIDED, chunks
        assert got.findings == [want], chunks
        assert got.max_held <= MAX_HOLDBACK
    assert seen(scan([text])) == ("ctx ", [want], True)


def test_a_foreign_tag_overlapping_the_owners_tag_is_not_cut() -> None:
    # Split inside the owner's tag, its first 7 characters go out (the context) and the copy is
    # stripped from there; what follows may join them into the owner's tag again. A foreign tag
    # that overlaps it that way, its key id contradicted, is ordinary text as in one chunk.
    own_tag = OWN.text[5:13]
    names = (f"n{i}" for i in range(10_000))
    neighbour = next(n for n in names if encode_tag(CODEC.tenant_tag(n))[0] == own_tag[-1])
    known = CODEC.known_tags([OWNER, "globex", neighbour])
    text = "x " + own_tag + "Q" * 24 + " " + encode_tag(CODEC.tenant_tag(neighbour)) + "77 tail"
    for chunks in splits(text, three_way=False):
        got = scan(chunks, known=known)
        assert (got.findings, got.cut) == ([], False), chunks


@pytest.mark.parametrize("prefix", ["", "CNRY-"])
def test_a_marker_right_after_the_own_marker_is_cut_at_every_split(prefix: str) -> None:
    # Split inside the own marker's tag, its first characters go out (the context) and the rest
    # of it is stripped; the foreign marker's first character then joins that context into the
    # owner's tag again. The foreign marker is still read whole, as in one chunk: found by the
    # props test (owner's body, then globex's, a first chunk of 9 characters).
    text = "ctx " + prefix + OWN.text[5:] + FOREIGN.text[5:] + " end"
    assert seen(scan([text])) == (
        "ctx ",
        [confirmed(FOREIGN, FindingKind.CROSS_TENANT, "globex", 4)],
        True,
    )
    want = (FindingKind.CROSS_TENANT, Evidence.CONFIRMED, "globex", FOREIGN.nonce)
    for chunks in splits(text, three_way=False):
        got = scan(chunks)
        # its position counts what went out before it in the split (the context): not compared
        found = [(f.kind, f.evidence, f.victim_tenant, f.victim_nonce) for f in got.findings]
        assert got.cut and found == [want], chunks
        assert len(fold_flat(got.text[len("ctx ") :])) <= UNDECIDED, chunks
        assert got.max_held <= MAX_HOLDBACK


def test_a_look_alike_holding_no_known_tag_is_stripped_as_before() -> None:
    # Control: ``CNRY-`` and up to 32 base32 characters holding no tag anyone has are stripped
    # whole, whatever their characters, and what follows the run goes out.
    rest = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567ABCD"
    for k in (1, 8, 24, 31):
        head = "Q" * k
        text = "ctx CNRY-" + head + rest + " end"
        want = "ctx " + rest[32 - k :] + " end"
        for chunks in splits(text, three_way=False):
            assert seen(scan(chunks)) == (want, [], False), chunks


def test_stripping_a_damaged_own_marker_does_not_eat_an_overlapping_foreign_one() -> None:
    own_tag = OWN.text[5:13]
    damaged_own_head = "CNRY-" + own_tag + "A" * 20  # + "CNRY" = 32 chars, bad MAC, own tag
    text = "<" + damaged_own_head + FOREIGN.text + ">"
    for chunks in splits(text):
        got = scan(chunks)
        assert (got.text, got.cut) == ("<", True), chunks
        assert got.findings == [confirmed(FOREIGN, FindingKind.CROSS_TENANT, "globex", 1)]


@pytest.mark.parametrize("tail", ["C", "CN", "CNR"])
def test_own_marker_whose_tail_starts_a_foreign_marker(tail: str) -> None:
    own = own_ending_with(tail)
    text = "<" + own.text + FOREIGN.text[len(tail) :]  # FOREIGN starts at own's last chars
    want = [confirmed(FOREIGN, FindingKind.CROSS_TENANT, "globex", 1)]
    for chunks in splits(text, three_way=False):
        assert seen(scan(chunks, own=[own.nonce])) == ("<", want, True), chunks
    for chunks in splits("<" + own.text + " ok", three_way=False):
        assert scan(chunks, own=[own.nonce]).text == "< ok", chunks


def test_stripping_cannot_assemble_a_marker_from_the_text_around_it() -> None:
    # "CNR" + own + "Y-<body>": removing the own marker hands the tenant "CNRY-<body>", so that
    # is what is judged -- another tenant's marker, cut before any of it goes out.
    text = "CNR" + OWN.text + "Y-" + FOREIGN.text[5:]
    for chunks in splits(text, three_way=False):
        got = scan(chunks)
        # At most the prefix went out (text delivered before the own marker showed is not taken
        # back), never a character of the body.
        assert got.cut and "CNRY-".startswith(got.text), chunks
        [found] = got.findings
        assert replace(found, position=0) == confirmed(
            FOREIGN, FindingKind.CROSS_TENANT, "globex", 0
        )
    # The own marker inside a foreign body's prefix-and-4 (a look-alike, stripped): what is left
    # names nobody and is no marker, however split.
    text = "CNRY-" + FOREIGN.text[5:9] + OWN.text + FOREIGN.text[9:]
    for chunks in splits(text, three_way=False):
        got = scan(chunks)
        assert genuine_markers_in("CNRY-" + got.text[-32:]) == [] and not got.findings, chunks


def test_back_to_back_markers() -> None:
    assert seen(scan([OWN.text + OWN.text + OWN_OLD_KEY.text])) == ("", [], False)
    want = [confirmed(FOREIGN, FindingKind.CROSS_TENANT, "globex", 0)]
    assert seen(scan([OWN.text + FOREIGN.text])) == ("", want, True)


def test_terminal_states_refuse_more_text() -> None:
    assert {ScannerState.CUT, ScannerState.FINISHED} == TERMINAL
    assert all(TRANSITIONS[state] == frozenset() for state in TERMINAL)
    cut = StreamScanner(CODEC, owner_tenant_id=OWNER, own_nonces=set(), known_tags=INDEX)
    assert cut.feed(FOREIGN.text).cut and cut.state is ScannerState.CUT
    with pytest.raises(ScannerStateError):
        cut.feed("more")
    with pytest.raises(ScannerStateError):
        cut.finish()
    done = StreamScanner(CODEC, owner_tenant_id=OWNER, own_nonces=set())
    assert done.feed("abc").text == "abc"
    assert done.finish().text == "" and done.state is ScannerState.FINISHED
    with pytest.raises(ScannerStateError):
        done.finish()


def test_own_nonces_must_be_eight_bytes() -> None:
    with pytest.raises(ValueError):
        StreamScanner(CODEC, owner_tenant_id=OWNER, own_nonces={b"short"})


def test_reprs_show_no_marker_or_completion_text() -> None:
    scanner = StreamScanner(CODEC, owner_tenant_id=OWNER, own_nonces=set(), known_tags=INDEX)
    scanner.feed("secret completion CNRY-" + FOREIGN.text[5:20])
    assert "secret" not in repr(scanner) and FOREIGN.text[5:13] not in repr(scanner)
    result = scanner.feed(FOREIGN.text[20:])
    finding = result.findings[0]
    for shown in (repr(result), repr(finding), str(finding)):
        assert "secret" not in shown and "CNRY" not in shown
        assert FOREIGN.text[5:13] not in shown and FOREIGN.nonce.hex() not in shown
    assert FOREIGN.tenant_tag.hex() in repr(finding) and "globex" in repr(finding)


def test_expose_lets_out_less_than_a_tag_whoever_it_belongs_to() -> None:
    """``expose``: the held-back text is going out anyway (a cut-only side field). At most
    ``CNRY-`` and 7 characters go out, whether or not they begin the request's own marker (that
    must change nothing the tenant can see: no oracle)."""

    def exposed(text: str) -> tuple[ScannerState, list[Finding] | None]:
        scanner = StreamScanner(
            CODEC, owner_tenant_id=OWNER, own_nonces={OWN.nonce}, known_tags=INDEX
        )
        assert scanner.feed(text).text == "x "
        result = scanner.expose()
        return scanner.state, None if result is None else list(result.findings)

    assert exposed("x " + FOREIGN.text[:12]) == (ScannerState.OPEN, None)
    assert exposed("x " + OWN.text[:12]) == (ScannerState.OPEN, None)
    assert exposed("x " + FOREIGN.text[:13]) == (
        ScannerState.CUT,
        [suspected(FOREIGN, "globex", 2)],
    )
    assert exposed("x " + FOREIGN.text[:30]) == (
        ScannerState.CUT,
        [suspected(FOREIGN, "globex", 2, visible=25)],
    )
    # Undecided, no finding: a stranger's start, the request's own, another request's of the owner.
    for marker in (STRANGER, OWN, OTHER_REQUEST):
        for shown in (13, 20, 36):
            assert exposed("x " + marker.text[:shown]) == (ScannerState.CUT, []), marker
