"""``canary.folding``: one folding for requests and answers, whatever a text's Unicode holds."""

from __future__ import annotations

import random
import sys
import unicodedata
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canary import folding
from canary.folding import MARKER_ALPHABET, fold, fold_flat, has_marker_characters

MARKER_BODY = "ABCDEFGH2345672QRSTUVWXYZ7IJKLMN"

TRICKY = [
    "",
    "plain ascii, CNRY-abc",
    "C\u0301N\u0301R\u0301Y\u0301",  # a combining acute after each letter: NFKC composes Ć Ń Ŕ Ý
    "".join(c + "\u0301" for c in MARKER_BODY),
    "".join(c + "\u0308\u0323" for c in MARKER_BODY.lower()),  # two marks, out of canonical order
    "\u0301CNRY",  # a lone mark first
    "e\u0301te\u0301",
    "ĆŃŔÝ café naïve Ångström",  # precomposed accented letters
    "ＣＮＲＹ－ａｂｃ",  # full-width
    "ﬁﬂ ﬀ ﬃ",  # ligatures
    "㎒ ℡ ™ ① ⅻ ½",  # compatibility forms with ASCII decompositions
    "Ǆ ǅ ǆ Ĳ ĳ",  # letters that decompose to two
    "ß ẞ Ø Æ ı İ ſ",  # no ASCII decomposition, or a dotless/dotted one
    "한국어 日本語 русский ελληνικά עברית العربية",
    "ᄀ\u1161\u11a8",  # conjoining jamo that NFKC composes into one syllable
    "a\u200bb\u00adc\ufeffd",  # zero-width and soft hyphen
    "\u212b\u2126\u212a",  # Angstrom, Ohm, Kelvin signs
    "x\u0338= \u2260",  # a combining overlay, and the precomposed not-equal sign
    "C\u20ddN\u20deR",  # enclosing marks (Me), not Mn
    "क्षि",  # a spacing mark (Mc)
]


@pytest.mark.parametrize("text", TRICKY)
def test_requests_and_answers_are_folded_alike(text: str) -> None:
    """``fold_flat`` (requests, evidence) is ``fold`` (answers) without positions: a marker the
    firewall reads in an answer is read in a request that holds the same text."""
    assert fold_flat(text) == fold(text).chars
    assert has_marker_characters(text) == bool(fold(text).chars)


def test_random_unicode_is_folded_alike() -> None:
    rng = random.Random(20261206)
    pool = [chr(c) for c in range(0x20, 0x3000) if unicodedata.category(chr(c))[0] != "C"]
    pool += [chr(0xFF00 + c) for c in range(0x01, 0x5F)] + ["\u0301", "\u0308", "\u200b"]
    for _ in range(300):
        text = "".join(rng.choice(pool) for _ in range(rng.randrange(1, 60)))
        assert fold_flat(text) == fold(text).chars, ascii(text)


def test_combining_marks_and_accents_do_not_hide_a_marker() -> None:
    """A mark after each letter, or a precomposed accented letter, folds to the letter; a lone
    mark is a separator, so the marker reads whole."""
    for text in (
        "".join(c + "\u0301" for c in "CNRY-" + MARKER_BODY),
        "ĆŃŔÝ-" + MARKER_BODY,
        "".join(unicodedata.normalize("NFC", c + "\u0301") for c in "CNRY" + MARKER_BODY),
    ):
        assert fold_flat(text) == "CNRY" + MARKER_BODY, ascii(text)
        assert fold(text).chars == "CNRY" + MARKER_BODY
    assert fold_flat("Ångström café É") == "ANGSTROMCAFEE"
    assert fold_flat("ß Ø Æ 日本 \u0301") == ""  # nothing ASCII underneath: separators


def test_accented_letters_are_letters_not_separators() -> None:
    """An accented letter folds to its base letter, never to nothing: dropping it used to join
    its neighbours (``CÉNRY`` read as ``CNRY``)."""
    assert fold("CÉNRY").chars == "CENRY"
    assert not fold("CÉNRY").anchored(0)
    assert set(fold_flat("àéîõüçñý")) <= set(MARKER_ALPHABET)


def _by_the_rule(text: str) -> str:
    """The folding rule itself, one character at a time."""
    return "".join(folding._fold_char(ch) for ch in text)


@contextmanager
def _python_calls() -> Iterator[list[int]]:
    """Counts the Python-level function calls made inside the block (``sys.setprofile``)."""
    count = [0]

    def profile(frame: object, event: str, arg: object) -> None:
        if event == "call":
            count[0] += 1

    sys.setprofile(profile)
    try:
        yield count
    finally:
        sys.setprofile(None)


def _poisoning_text() -> str:
    """One request's worth of distinct non-BMP code points: more than any cache of 65,536."""
    return "".join(chr(0x10000 + (i * 7919) % 0x100000) for i in range(70_000))


ORDINARY = {
    "cyrillic": "Съешь же ещё этих мягких французских булок. " * 1500,
    "french": "Voilà un été très agréable à Genève, où l'on mange des crêpes. " * 1000,
    "greek and cjk": "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. 我能吞下玻璃而不伤身体。" * 1000,
    "ligatures": "ﬁne ﬂour, ﬃ ㎒ ℡ Ǆ " * 2000,
}


@pytest.mark.parametrize("name", sorted(ORDINARY))
@pytest.mark.parametrize("reader", [fold_flat, fold], ids=["fold_flat", "fold"])
def test_folding_costs_the_same_after_a_request_of_every_code_point(
    name: str, reader: Callable[[str], object]
) -> None:
    """One request of more than 65,536 distinct code points used to fill the process-wide fold
    cache for good, after which every tenant's ordinary non-ASCII text was folded in Python one
    character at a time until the process restarted. Folding makes no Python call per
    character, whatever any text before it held."""
    poison = _poisoning_text()
    assert fold_flat(poison) == _by_the_rule(poison)
    assert fold(poison).chars == _by_the_rule(poison)
    text = ORDINARY[name]
    with _python_calls() as calls:
        reader(text)
    assert calls[0] < 50, calls[0]
    assert fold_flat(text) == fold(text).chars == _by_the_rule(text)


def test_every_code_point_folds_by_the_rule() -> None:
    """The folding of each code point, alone and all of them in one text, is the per-character
    rule (``_fold_char``): NFKD, marks of category Mn dropped, the marker alphabet upper-cased,
    nothing when anything else is left."""
    everything = [chr(c) for c in range(sys.maxunicode + 1)]
    expected = [folding._fold_char(ch) for ch in everything]
    assert fold_flat("".join(everything)) == "".join(expected)
    assert fold("".join(everything)).chars == "".join(expected)
    wrong = [ch for ch, want in zip(everything, expected, strict=True) if fold_flat(ch) != want]
    assert not wrong, [ascii(ch) for ch in wrong[:20]]


def _folding_alphabet() -> list[str]:
    """Characters worth combining: every one that folds to something, marks, separators."""
    folding_chars = [chr(c) for c in range(sys.maxunicode + 1) if folding._fold_char(chr(c))]
    return folding_chars + [
        "\u0301",
        "\u0308",
        "\u0323",
        "\u20dd",
        "\u200b",
        " ",
        "-",
        "\x00",
        "\ud800",
        "\udfff",
    ]


_ALPHABET = _folding_alphabet()


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(_ALPHABET),
            st.characters(codec=None),
            st.characters(min_codepoint=0x10000),
        ),
        max_size=80,
    )
)
def test_any_text_folds_by_the_rule(chars: list[str]) -> None:
    """Any text, non-BMP characters, lone surrogates and marks in any order included, folds as
    its characters do one at a time, in ``fold`` and ``fold_flat`` alike; every folded
    character's position is where the character it comes from stands."""
    text = "".join(chars)
    want = _by_the_rule(text)
    assert fold_flat(text) == want
    view = fold(text)
    assert view.chars == want
    got = [view.pos(i) for i in range(len(want))]
    assert got == [i for i, ch in enumerate(text) for _ in folding._fold_char(ch)]
    assert has_marker_characters(text) == bool(want)
