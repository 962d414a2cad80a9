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
and cuts there); ``fold_flat`` is the same folding without positions or runs, at C speed, for
whole requests: ``fold_flat(text) == fold(text).chars`` for every text (a marker the firewall
reads in an answer is read in a request holding the same text; it used to normalise requests
whole, composing ``C`` and a combining acute into ``Ć``, which it then dropped). Not undone:
homoglyphs from other scripts, encodings (reversed, base64, ROT13), and letters put between a
marker's characters -- disguises a model can only be *told* to make.

An accented letter is a letter, not a separator (it used to be dropped, joining its neighbours:
``CÉNRY`` read as ``CNRY``), so accented text folds like English text of the same letters.
"""

from __future__ import annotations

import bisect
import unicodedata

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


class _FoldTable(dict[int, str]):
    """Code point -> its folded characters, for ``str.translate``: looked up at C speed, computed
    by ``_fold_char`` on first sight; bounded, so a request of every code point cannot grow it
    without end (past the bound a new character is computed each time)."""

    LIMIT = 1 << 16

    def __missing__(self, code: int) -> str:
        folded = _fold_char(chr(code))
        if len(self) < self.LIMIT:
            self[code] = folded
        return folded


_FOLDS = _FoldTable({c: _fold_char(chr(c)) for c in range(128)})


def fold_flat(text: str) -> str:
    """The folded characters of ``text`` in order, runs not told apart (a whole request):
    ``fold(text).chars`` without positions."""
    if text.isascii():
        return fold_ascii(text)
    return text.translate(_FOLDS)


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
        self._mapped = mapped  # the text with every separator as _SEP (ASCII texts)
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
    folds = _FOLDS
    folded: list[str] = []
    pos: list[int] = []
    for i, ch in enumerate(text):
        for c in folds[ord(ch)]:
            folded.append(c)
            pos.append(i)
    return Folded(text, "".join(folded), None, pos)
