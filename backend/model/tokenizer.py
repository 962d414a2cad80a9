"""Tokenizers of a checkpoint: the bundled model's byte tokenizer, or a `tokenizer.json`.

Lifecycle of a streaming decode: the runner asks `tokenizer.stream_decoder()` once per request,
calls `push(token_id)` for every generated token and sends whatever text it returns (possibly
""), then calls `flush()` once when the request ends. Text is released only when its bytes form
complete UTF-8 characters, so a multi-byte character split across tokens never reaches a client
as two replacement characters; `flush()` turns a trailing incomplete sequence into U+FFFD.

`encode` never adds BOS/EOS: the runner prepends `bos_id` itself when the model wants one.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from tokenizers import Tokenizer as RustTokenizer
from tokenizers.decoders import DecodeStream

from backend.model.config import BYTE_TOKENIZER, CONFIG_FILE, ModelConfig
from backend.model.errors import CheckpointError

TOKENIZER_FILE = "tokenizer.json"

BYTE_BOS = 256
BYTE_EOS = 257
BYTE_PAD = 258
BYTE_VOCAB_SIZE = 259


class StreamDecoder(Protocol):
    def push(self, token_id: int) -> str: ...

    def flush(self) -> str: ...


class Tokenizer(Protocol):
    @property
    def bos_id(self) -> int | None: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def stop_ids(self) -> frozenset[int]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def stream_decoder(self) -> StreamDecoder: ...


class ByteTokenizer:
    """ids 0..255 are the UTF-8 bytes of the text; 256 BOS, 257 EOS, 258 PAD; vocabulary 259.

    Special ids decode to no text. Invalid UTF-8 decodes to U+FFFD, the same way in `decode`
    and in the stream decoder.
    """

    __slots__ = ()

    @property
    def bos_id(self) -> int:
        return BYTE_BOS

    @property
    def eos_id(self) -> int:
        return BYTE_EOS

    @property
    def pad_id(self) -> int:
        return BYTE_PAD

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset({BYTE_EOS})

    @property
    def vocab_size(self) -> int:
        return BYTE_VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return _text_bytes(ids).decode("utf-8", errors="replace")

    def stream_decoder(self) -> ByteStreamDecoder:
        return ByteStreamDecoder()


class ByteStreamDecoder:
    """Incremental UTF-8 decoding of byte-token ids (see the module docstring)."""

    __slots__ = ("_decoder",)

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return str(self._decoder.decode(_text_bytes([token_id])))

    def flush(self) -> str:
        return str(self._decoder.decode(b"", final=True))


def _text_bytes(ids: Sequence[int]) -> bytes:
    for token_id in ids:
        if not 0 <= token_id < BYTE_VOCAB_SIZE:
            raise ValueError(f"token id {token_id} is outside the byte vocabulary")
    return bytes(i for i in ids if i < 256)


class HFTokenizer:
    """A `tokenizers.Tokenizer` from `tokenizer.json`; BOS/EOS ids come from config.json."""

    __slots__ = ("_bos", "_eos", "_tok")

    def __init__(self, path: Path, config: ModelConfig) -> None:
        try:
            self._tok = RustTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises plain Exception on any parse error
            raise CheckpointError(path, f"cannot be parsed: {exc}") from exc
        if self._tok.get_vocab_size(with_added_tokens=True) > config.vocab_size:
            raise CheckpointError(
                path,
                f"{self._tok.get_vocab_size(with_added_tokens=True)} tokens exceed the model's "
                f"vocab_size {config.vocab_size}",
            )
        self._bos = config.bos_token_id
        self._eos = config.eos_token_ids

    @property
    def bos_id(self) -> int | None:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos[0]

    @property
    def stop_ids(self) -> frozenset[int]:
        return frozenset(self._eos)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def stream_decoder(self) -> HFStreamDecoder:
        return HFStreamDecoder(self._tok)


class HFStreamDecoder:
    """Wraps `tokenizers.decoders.DecodeStream`, which holds text back until it is valid UTF-8."""

    __slots__ = ("_pending", "_stream", "_tok")

    def __init__(self, tok: RustTokenizer) -> None:
        self._tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)
        self._pending: list[int] = []

    def push(self, token_id: int) -> str:
        self._pending.append(token_id)
        chunk = self._stream.step(self._tok, token_id)
        if chunk is None:
            return ""
        self._pending.clear()
        return str(chunk)

    def flush(self) -> str:
        if not self._pending:
            return ""
        text = self._tok.decode(self._pending, skip_special_tokens=True)
        self._pending.clear()
        return str(text)


def load_tokenizer(checkpoint_dir: Path | str, config: ModelConfig) -> Tokenizer:
    """The tokenizer `config` asks for; refuses a byte model whose ids disagree with 256/257."""
    if config.kvguard_tokenizer == BYTE_TOKENIZER:
        _check_byte_config(Path(checkpoint_dir) / CONFIG_FILE, config)
        return ByteTokenizer()
    path = Path(checkpoint_dir) / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(path, "file is missing (and config.json sets no kvguard_tokenizer)")
    return HFTokenizer(path, config)


def _check_byte_config(path: Path, config: ModelConfig) -> None:
    if config.vocab_size < BYTE_VOCAB_SIZE:
        raise CheckpointError(
            path, f"field 'vocab_size': the byte tokenizer needs >= {BYTE_VOCAB_SIZE}"
        )
    if config.bos_token_id not in (None, BYTE_BOS):
        raise CheckpointError(path, f"field 'bos_token_id': the byte tokenizer's BOS is {BYTE_BOS}")
    if BYTE_EOS not in config.eos_token_ids:
        raise CheckpointError(path, f"field 'eos_token_id': the byte tokenizer's EOS is {BYTE_EOS}")
