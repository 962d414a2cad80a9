"""Reading text for markers whatever a model did to their form: the folded view. Pure.

A model can bend how it copies a marker: a sampled tenant's ``logit_bias`` that forbids ``-``
made the bundled model write ``CNRY|<body>``, and a model that follows instructions spaces a
marker out, lowercases it or writes it on several lines. What makes a marker a marker survives
all of that: its 32 body characters, the first 8 a tenant's tag, the last 48 bits a MAC
(``canary.markers``). So every reader of markers -- the stream scanner, the edge check on
requests, the replay evidence -- reads text *folded*:

- every character that is a marker character in some case -- ``A``-``Z``, ``a``-``z``, ``2``-``7``
  or a compatibility form of one (full-width letters, ligatures: NFKD) or one with accents
  (``É``, or ``E`` followed by a combining mark: marks of category Mn are dropped) -- becomes
  the upper-case marker character(s); every other character (spaces, dashes, bars, dots,
  zero-width characters, lone combining marks, the digits 0, 1, 8, 9, other scripts) is a
  *separator* and is dropped. Each character is folded on its own (``_fold_char``), never the
  text as a whole, so every reader folds every text alike;
- folded characters make one *run* while at most ``MAX_GAP`` separators stand between two
  neighbours: a marker is written as one piece, however it is spaced, and a longer gap (a
  paragraph, a table's padding) ends the run.

``fold`` keeps the position of every folded character in the original text (the scanner strips
and cuts there); ``fold_flat`` is the same folding without positions or runs, for whole
requests: ``fold_flat(text) == fold(text).chars`` for every text (a marker the firewall
reads in an answer is read in a request holding the same text; it used to normalise requests
whole, composing ``C`` and a combining acute into ``Ć``, which it then dropped). Not undone:
homoglyphs from other scripts, encodings (reversed, base64, ROT13), and letters put between a
marker's characters -- disguises a model can only be *told* to make.

An accented letter is a letter, not a separator (it used to be dropped, joining its neighbours:
``CÉNRY`` read as ``CNRY``), so accented text folds like English text of the same letters.

The cost of folding a text depends on that text alone, and is C speed on any text. At import
``_fold_char`` is applied to every code point that can fold to something (ASCII, and the blocks
where some character decomposes: 0.07 s), giving ``_FOLDS``, the complete list of the code
points that fold to some characters (1,783); every other one is a separator. Texts are then
folded without a Python call per character: ASCII by ``bytes.translate``; Latin-1 by
``bytes.translate`` with tables built from ``_FOLDS``; any other text has what folds to nothing
deleted by a regular expression (its class built from ``_FOLDS``), then what is left -- ASCII,
and characters whose decomposition is ASCII and Mn marks -- decomposed (NFKD) whole, the marks
dropped as its non-ASCII characters. Decomposing whole reads like decomposing each character on
its own there: NFKD never composes, and reordering moves marks only among marks, all dropped.
(``_FOLDS`` used to be a cache filled on first sight of each character and bounded at 65,536
entries: one request of more than 65,536 distinct characters filled it for good, and from then
on every tenant's non-ASCII text not already in it was folded in Python, a character at a time.)
``tests/canary/test_canary_folding.py`` checks every code point, alone and all in one text, and
random texts against ``_fold_char``.
"""

from __future__ import annotations

import bisect
import re
import sys
import unicodedata
from array import array

MARKER_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
ANCHOR = "CNRY"
"""The marker prefix ``CNRY-`` folded: the dash is a separator like any other."""
MAX_GAP = 8
"""The most separators between two characters of one run."""

_SEP = "\x00"
_NEAR = 16  # characters counted one by one rather than all positions listed
_ASCII_FOLD = str.maketrans(
    {chr(c): (chr(c).upper() if chr(c).upper() in MARKER_ALPHABET else _SEP) for c in range(128)}
)
# The same folding of ASCII as bytes, for ``bytes.translate`` (a table lookup per byte, where
# ``str.translate`` with a mapping looks each character up in a dict): what is not a marker
# character in some case is deleted, the rest upper-cased. The scanner's per-chunk path
# (``StreamScanner.passes``) applies them as ``fold_ascii`` does, without the call.
BYTE_UPPER = bytes(ord(chr(c).upper()) if c < 128 else c for c in range(256))
BYTE_SEPARATORS = bytes(c for c in range(256) if chr(c).upper() not in MARKER_ALPHABET)


def _fold_char(ch: str) -> str:
    """The folded characters one character stands for (often none): its compatibility
    decomposition (NFKD: full-width forms, ligatures, accented letters) without combining marks
    (category Mn: accents, whether precomposed or written after the letter), folded when what is
    left is ASCII, else nothing. One character at a time, so that ``fold`` and ``fold_flat`` read
    every text alike: a whole-text normalisation would compose a letter with the mark after it
    into a letter with no ASCII form."""
    parts = unicodedata.normalize("NFKD", ch)
    if not parts.isascii():
        parts = "".join(c for c in parts if unicodedata.category(c) != "Mn")
        if not parts.isascii():
            return ""
    return parts.translate(_ASCII_FOLD).replace(_SEP, "")


def _folding_code_points() -> dict[int, str]:
    """Every code point whose fold is not empty, with its fold (by ``_fold_char``). A character
    that does not decompose (NFKD) folds to itself when it is ASCII and to nothing otherwise (a
    mark, or something that is not ASCII), so only ASCII and the blocks where some character
    decomposes are read one by one: about 30,000 of the 1,114,112 code points, once, at import."""
    codes = array("I", range(sys.maxunicode + 1)).tobytes()
    everything = codes.decode("utf-32-le", "surrogatepass")
    folds: dict[int, str] = {}
    for start in range(0, len(everything), _BLOCK):
        block = everything[start : start + _BLOCK]
        if start and unicodedata.is_normalized("NFKD", block):
            continue  # nothing here decomposes, nothing is ASCII: every fold is empty
        for offset, ch in enumerate(block):
            folded = _fold_char(ch)
            if folded:
                folds[start + offset] = folded
    return folds


def _char_class(codes: list[int]) -> str:
    """A regular expression character class's inside for ``codes`` (sorted), as ranges."""
    ranges: list[list[int]] = []
    for code in codes:
        if ranges and ranges[-1][1] == code - 1:
            ranges[-1][1] = code
        else:
            ranges.append([code, code])
    return "".join(f"\\U{lo:08x}" if lo == hi else f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges)


_BLOCK = 256
_FOLDS = _folding_code_points()
"""Code point -> its folded characters, for every code point that folds to some (1,783 with
Python 3.11's Unicode data); every other one is a separator. Complete and never added to."""
_BMP_KEPT = f"[{_char_class([c for c in sorted(_FOLDS) if c <= 0xFFFF])}\\U00010000-\\U0010ffff]"
_DROP_BMP = re.compile(f"[^{_BMP_KEPT[1:]}[^{_BMP_KEPT[1:]}*")
"""Runs of characters of the Basic Multilingual Plane that fold to nothing (a table lookup per
character: the class is a bitmap; written ``[^…][^…]*`` rather than ``[^…]+`` so that the search
for a run is the class's own scan, not a match tried at each character)."""
_HAS_NON_BMP = re.compile("[\\U00010000-\\U0010ffff]")
_NON_BMP_KEPT = f"[\\x00-\\uffff{_char_class([c for c in sorted(_FOLDS) if c > 0xFFFF])}]"
_DROP_NON_BMP = re.compile(f"[^{_NON_BMP_KEPT[1:]}[^{_NON_BMP_KEPT[1:]}*")
"""Runs of characters outside the Basic Multilingual Plane that fold to nothing (a few dozen
ranges tried in turn: only for texts that hold such characters)."""
_KEPT = bytearray(sys.maxunicode + 1)
for _code in _FOLDS:
    _KEPT[_code] = 1
_MAPPED = _KEPT.decode("latin-1")
"""For ``str.translate``: ``_SEP`` for every code point that folds to nothing, ``\\x01`` for
one that folds to some."""
del _KEPT, _code
_FOLDED_AT = re.compile("[^\\x00]")
_LATIN1_UPPER = bytes(ord(_FOLDS.get(c, "?")[0]) for c in range(256))
_LATIN1_SEPARATORS = bytes(c for c in range(256) if c not in _FOLDS)
_LATIN1_MAPPED = bytes(0 if c in _LATIN1_SEPARATORS else 1 for c in range(256))
"""``fold_flat`` and ``_MAPPED`` of a Latin-1 text as ``bytes.translate`` tables."""
_LATIN1_BYTEWISE = all(len(_FOLDS.get(c, "")) <= 1 for c in range(256))
"""Whether every Latin-1 character folds to one character or none, as the tables need (true of
every Unicode version so far; were it not, Latin-1 texts would take the general way)."""


def fold_flat(text: str) -> str:
    """The folded characters of ``text`` in order, runs not told apart (a whole request):
    ``fold(text).chars`` without positions. No Python call per character (the module's
    docstring says how)."""
    if text.isascii():
        return fold_ascii(text)
    latin1 = _latin1(text)
    if latin1 is not None:  # accented Western European text: a table lookup per byte
        return latin1.translate(_LATIN1_UPPER, _LATIN1_SEPARATORS).decode("ascii")
    kept = _DROP_BMP.sub("", text)
    if not kept.isascii():
        if _HAS_NON_BMP.search(kept):
            kept = _DROP_NON_BMP.sub("", kept)
        ascii_kept = unicodedata.normalize("NFKD", kept).encode("ascii", "ignore")
        return ascii_kept.translate(BYTE_UPPER, BYTE_SEPARATORS).decode("ascii")
    return fold_ascii(kept)


def _latin1(text: str) -> bytes | None:
    """``text`` in Latin-1 when every character is in it (and Latin-1 folds byte by byte)."""
    if not _LATIN1_BYTEWISE:
        return None
    latin1 = text.encode("latin-1", "ignore")  # no exception raised: a cost for a short text
    return latin1 if len(latin1) == len(text) else None


def fold_ascii(text: str) -> str:
    """``fold_flat`` of an ASCII text (the caller checked ``text.isascii()``)."""
    return text.encode("ascii").translate(BYTE_UPPER, BYTE_SEPARATORS).decode("ascii")


def has_marker_characters(text: str) -> bool:
    """Whether ``text`` holds any character that folds to a marker character."""
    if text.isascii():
        return len(text.encode("ascii").translate(None, BYTE_SEPARATORS)) > 0
    return bool(fold_flat(text))


class Folded:
    """``text`` folded: ``chars``, and for folded character ``i`` where it stands in the text
    (``pos``) and where its run ends (``stop``); ``open_end``: the last run may continue with
    more text. Positions are found when asked (the scanner asks for a few per chunk), runs are
    one unless the text has more separators than ``MAX_GAP`` in all."""

    __slots__ = ("_ends", "_mapped", "_pos", "chars", "open_end", "text")

    def __init__(self, text: str, chars: str, mapped: str | None, pos: list[int] | None) -> None:
        self.text = text
        self.chars = chars
        self._mapped = mapped  # the text, separators as _SEP (each other character folds to one)
        self._pos = pos
        n = len(chars)
        if not n:
            first, last = 0, -1
        elif mapped is not None:
            first, last = len(mapped) - len(mapped.lstrip(_SEP)), len(mapped.rstrip(_SEP)) - 1
        else:
            first, last = self.pos(0), self.pos(n - 1)
        self.open_end = n > 0 and len(text) - last - 1 <= MAX_GAP
        self._ends: list[int] | None = None  # None: one run
        if last - first - (n - 1) > MAX_GAP:  # enough separators for a gap somewhere
            p = self._positions()
            ends = [j for j in range(1, n) if p[j] - p[j - 1] > MAX_GAP + 1]
            self._ends = [*ends, n] if ends else None

    def __repr__(self) -> str:
        return f"Folded(<{len(self.text)} chars>, folded={len(self.chars)})"

    def pos(self, i: int) -> int:
        """Where folded character ``i`` stands in the text."""
        if self._pos is not None:
            return self._pos[i]
        mapped, n = self._mapped, len(self.chars)
        assert mapped is not None
        if n == len(mapped):  # no separator at all
            return i
        if i >= n // 2:  # count from the end: the scanner asks about the last few characters
            j, seen = len(mapped), n
            while seen > i:
                j -= 1
                if mapped[j] != _SEP:
                    seen -= 1
            return j
        if i < _NEAR:  # count from the start: a candidate at the front of what is held
            j, seen = -1, -1
            while seen < i:
                j += 1
                if mapped[j] != _SEP:
                    seen += 1
            return j
        return self._positions()[i]

    def _positions(self) -> list[int]:
        if self._pos is None:
            assert self._mapped is not None
            self._pos = [i for i, ch in enumerate(self._mapped) if ch != _SEP]
        return self._pos

    def stop(self, i: int) -> int:
        """The end (exclusive) of the run holding folded character ``i``."""
        ends = self._ends
        if ends is None:
            return len(self.chars)
        return ends[bisect.bisect_right(ends, i)]

    def index_at(self, offset: int) -> int:
        """The first folded character at or after text offset ``offset``."""
        if offset == 0:
            return 0
        return bisect.bisect_left(self._positions(), offset)

    def offset(self, i: int) -> int:
        """Where folded character ``i`` stands in the text (after the last one: its end)."""
        if i < len(self.chars):
            return self.pos(i)
        return self.pos(len(self.chars) - 1) + 1 if self.chars else 0

    def run_open(self, i: int) -> bool:
        """Whether the run holding character ``i`` reaches the end and may still grow."""
        return self.open_end and self.stop(i) == len(self.chars)

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The original text from folded character ``start`` to ``end`` (exclusive)."""
        return self.pos(start), self.pos(end - 1) + 1

    def anchored(self, i: int) -> bool:
        """Whether a folded ``CNRY`` starts at ``i`` with at least one character after it."""
        return self.chars.startswith(ANCHOR, i) and self.stop(i) > i + len(ANCHOR)


def fold(text: str) -> Folded:
    if text.isascii():
        mapped = text.translate(_ASCII_FOLD)
        return Folded(text, mapped.replace(_SEP, ""), mapped, None)
    chars = fold_flat(text)
    if not chars:
        return Folded(text, "", None, [])
    latin1 = _latin1(text)
    if latin1 is not None:
        mapped = latin1.translate(_LATIN1_MAPPED).decode("latin-1")
    else:
        mapped = text.translate(_MAPPED)
    if len(mapped) - mapped.count(_SEP) == len(chars):  # each character folds to one
        return Folded(text, chars, mapped, None)
    # some character folds to several (a ligature): each of them stands where that character does
    pos = [m.start() for m in _FOLDED_AT.finditer(mapped) for _ in _FOLDS[ord(text[m.start()])]]
    return Folded(text, chars, None, pos)
