"""Incremental detokenization: generated token ids -> text deltas that are safe to send.

Lifecycle per request: the server asks the tokenizer for a `StreamDecoder` primed with the
prompt's ids, calls `push(token_id)` for every generated token and sends what it returns
(possibly ""), then calls `flush()` once when generation ends.

The contract, for any ids (the model may sample anything in its vocabulary):
- nothing raises: a request never fails because of its text;
- no released text is ever taken back, so nothing is released that a later token could still
  change: a character whose bytes are still arriving (the decoded text ends in U+FFFD), or, with
  a byte-fallback decoder (Llama 2, Mistral), a trailing run of ``<0xNN>`` byte tokens, which the
  decoder regroups as a whole (an invalid byte turns the whole run into U+FFFD; a special token
  in between does not end the run, decode drops it first);
- the pieces joined equal the tokenizer's decode of prompt + completion minus its decode of the
  prompt. So the first token keeps its leading space ("▁Hello" after a prompt is " Hello": a
  Metaspace decoder strips it only at the start of a text);
- `flush` releases the rest, except a character cut by the end of generation: its bytes never
  all arrived, so it is left out rather than sent as U+FFFD. Invalid bytes that did arrive are
  U+FFFD, exactly as in decode.

How: the classic two-offset scheme (prefix .. read is text already released, kept as left
context; read .. end is pending), re-decoding only that short window per token, with the prompt's
last few tokens as the first window's context. The bytes of a token, needed only to tell a cut
character at the end, are known for the two byte schemes real checkpoints use (byte-level BPE's
byte-to-character table, and ``<0xNN>`` byte fallback).
"""

from __future__ import annotations

import codecs
import logging
import re
from collections.abc import Callable, Sequence
from typing import Protocol

from tokenizers import Tokenizer as RustTokenizer

log = logging.getLogger("kvguard.detokenizer")

REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# The prompt's last tokens decoded as context: enough for any decoder's left context (Metaspace
# needs one); more only costs a longer first window.
_PRIME_TOKENS = (4, 8, 16)


class StreamDecoder(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class ByteStreamDecoder:
    """UTF-8 bytes (ids 0..255; higher ids are specials and carry no text)."""

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        if not 0 <= token_id < 256:
            return ""
        return str(self._decoder.decode(bytes([token_id])))

    def flush(self) -> str:
        self._decoder.reset()  # a character still missing bytes at the end is left out
        return ""


def incomplete_tail(data: bytes) -> int:
    """How many bytes at the end of `data` start a UTF-8 character that is not complete."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(data)
    pending, _ = decoder.getstate()
    return len(pending)


def byte_level_table() -> dict[str, int]:
    """Byte-level BPE's (GPT-2's) character -> byte table: the printable Latin-1 bytes stand for
    themselves, the other 68 bytes for the code points 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = (b for b in range(256) if b not in table.values())
    for offset, b in enumerate(shifted):
        table[chr(256 + offset)] = b
    return table


class TokenBytes:
    """The raw bytes of a token, for the byte scheme the tokenizer's decoder uses."""

    def __init__(self, tok: RustTokenizer, scheme: str | None) -> None:
        self._tok = tok
        self.scheme = scheme  # "byte_level", "byte_fallback" or None (unknown: not needed)
        self._table = byte_level_table() if scheme == "byte_level" else {}
        self._added = {i for i, t in tok.get_added_tokens_decoder().items() if t.special}

    def fallback_byte(self, token_id: int) -> int | None:
        """The byte of a ``<0xNN>`` piece when the decoder regroups those, else None."""
        if self.scheme != "byte_fallback":
            return None
        match = _BYTE_PIECE.fullmatch(self._tok.id_to_token(token_id) or "")
        return int(match.group(1), 16) if match else None

    def textless(self, token_id: int) -> bool:
        """A token decode skips: a special token, or a row of the model with no token."""
        return token_id in self._added or self._tok.id_to_token(token_id) is None

    def of(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id)
        if piece is None or token_id in self._added:
            return b""  # no text (see `textless`)
        if self.scheme == "byte_level" and all(ch in self._table for ch in piece):
            return bytes(self._table[ch] for ch in piece)
        byte = self.fallback_byte(token_id)
        if byte is not None:
            return bytes([byte])
        return piece.replace("▁", " ").encode("utf-8")


class HFStreamDecoder:
    """Incremental decoding with a `tokenizers.Tokenizer` (see the module docstring)."""

    __slots__ = ("_bytes", "_decode", "_ids", "_prefix", "_read")

    def __init__(
        self, decode: Callable[[Sequence[int]], str], token_bytes: TokenBytes, prompt: Sequence[int]
    ) -> None:
        self._decode = decode
        self._bytes = token_bytes
        self._ids = _prime(decode, token_bytes, prompt)
        self._prefix = 0
        self._read = len(self._ids)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        if self._bytes.textless(token_id) or self._bytes.fallback_byte(token_id) is not None:
            # Nothing new to show, or a byte run that may still regroup (see the module doc);
            # a skipped special token does not end a run: decode drops it before grouping.
            return ""
        return self._release(self._ids)

    def flush(self) -> str:
        if self._read == len(self._ids):
            return ""
        ids, trim = self._ids, self._bytes.scheme is None
        cut = incomplete_tail(b"".join(self._bytes.of(i) for i in self._ids[self._read :]))
        if cut and self._bytes.scheme == "byte_fallback":
            ids = list(ids)  # the cut bytes are the last byte pieces: leave them out
            while cut > 0:
                cut -= len(self._bytes.of(ids.pop()))
        elif cut and self._bytes.scheme == "byte_level":
            trim = True  # lossy decoding made the cut bytes one trailing U+FFFD
        return self._release(ids, final=True, trim=trim)

    def _release(self, ids: list[int], *, final: bool = False, trim: bool = False) -> str:
        try:
            released = self._decode(ids[self._prefix : self._read])
            text = self._decode(ids[self._prefix :])
        except Exception:  # a tokenizer bug must not fail the request: skip these tokens
            log.warning("detokenizer: decode failed; %d tokens left out", len(ids) - self._read)
            self._prefix = self._read = len(self._ids)
            return ""
        if trim and text.endswith(REPLACEMENT):
            text = text[:-1]
        if not final and (text.endswith(REPLACEMENT) or len(text) <= len(released)):
            return ""  # a character still arriving, or nothing new yet
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(released) :]


def _prime(
    decode: Callable[[Sequence[int]], str], token_bytes: TokenBytes, prompt: Sequence[int]
) -> list[int]:
    """The prompt's last few ids, starting where decoding can start cleanly: not inside a byte
    run, and no U+FFFD in their text. A byte run (or text-less tokens) at the prompt's end is
    left out: generated byte tokens would otherwise join the run, and one stray byte would turn
    the prompt's last character into U+FFFD in the window's text."""
    end = len(prompt)
    while end and (
        token_bytes.fallback_byte(prompt[end - 1]) is not None
        or token_bytes.textless(prompt[end - 1])
    ):
        end -= 1
    for count in _PRIME_TOKENS:
        start = max(0, end - count)
        if start and token_bytes.fallback_byte(prompt[start - 1]) is not None:
            continue
        try:
            clean = REPLACEMENT not in decode(prompt[start:end])
        except Exception:  # as in `_release`: decoding problems never fail the request
            log.warning("detokenizer: the prompt's last tokens do not decode; no left context")
            return []
        if clean:
            return list(prompt[start:end])
        if start == 0:
            break
    return []
