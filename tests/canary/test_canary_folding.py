"""``canary.folding``: one folding for requests and answers, whatever a text's Unicode holds."""

from __future__ import annotations

import random
import unicodedata

import pytest

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
