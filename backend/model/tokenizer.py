"""Tokenizers of a checkpoint: the bundled model's byte tokenizer, or a `tokenizer.json`.

Encoding follows transformers: `encode(text)` adds the special tokens the tokenizer itself adds
(the `post_processor` of `tokenizer.json`: `<s>` for Llama 2, none for GPT-2 style ones), and
`encode(text, add_special_tokens=False)` adds none, which is how a rendered chat is encoded (the
template writes its own BOS). `config.json`'s `bos_token_id` plays no part.

Stop tokens are every end id the checkpoint names: `eos_token_id` of config.json and of
generation_config.json (where chat checkpoints keep their end-of-turn token) and the tokenizer's
`eos_token`. Streaming decode is `backend.model.detokenizer`'s.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer as RustTokenizer

from backend.model.config import BYTE_TOKENIZER, CONFIG_FILE, ModelConfig, generation_eos_ids
from backend.model.detokenizer import ByteStreamDecoder, HFStreamDecoder, StreamDecoder, TokenBytes
from backend.model.errors import CheckpointError
from backend.model.tokenizer_config import TOKENIZER_CONFIG_FILE, TokenizerFiles

TOKENIZER_FILE = "tokenizer.json"

BYTE_BOS = 256
BYTE_EOS = 257
BYTE_PAD = 258
BYTE_VOCAB_SIZE = 259

__all__ = ["ByteTokenizer", "HFTokenizer", "StreamDecoder", "Tokenizer", "load_tokenizer"]


class Tokenizer(Protocol):
    @property
    def eos_id(self) -> int: ...

    @property
    def stop_ids(self) -> frozenset[int]: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def token_text(self, token_id: int) -> str: ...

    def stream_decoder(self, prompt_ids: Sequence[int] = ()) -> StreamDecoder: ...


class ByteTokenizer:
    """ids 0..255 are the UTF-8 bytes of the text; 256 BOS, 257 EOS, 258 PAD; vocabulary 259.

    Encoding with special tokens prepends BOS. Special ids decode to no text. Invalid UTF-8
    decodes to U+FFFD, the same way in `decode` and in the stream decoder.
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

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BYTE_BOS, *ids] if add_special_tokens else ids

    def decode(self, ids: Sequence[int]) -> str:
        return _text_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (none for specials)."""
        return bytes([token_id]) if 0 <= token_id < 256 else b""

    def token_text(self, token_id: int) -> str:
        """A token's own text (logprobs' ``token``): a lone byte of a character is U+FFFD."""
        return self.decode([token_id])

    def stream_decoder(self, prompt_ids: Sequence[int] = ()) -> ByteStreamDecoder:
        return ByteStreamDecoder()  # bytes need no left context


def _text_bytes(ids: Sequence[int]) -> bytes:
    for token_id in ids:
        if not 0 <= token_id < BYTE_VOCAB_SIZE:
            raise ValueError(f"token id {token_id} is outside the byte vocabulary")
    return bytes(i for i in ids if i < 256)


class HFTokenizer:
    """A `tokenizers.Tokenizer` from `tokenizer.json` (see the module docstring)."""

    __slots__ = ("_bytes", "_eos", "_marker", "_stops", "_tok")

    def __init__(self, path: Path, config: ModelConfig) -> None:
        try:
            self._tok = RustTokenizer.from_file(str(path))
            spec = json.loads(path.read_text(encoding="utf-8"))
        except Exception as exc:  # the Rust side raises plain Exception on any parse error
            raise CheckpointError(path, f"cannot be parsed: {exc}") from exc
        if self.vocab_size > config.vocab_size:
            raise CheckpointError(
                path, f"{self.vocab_size} tokens exceed the model's vocab_size {config.vocab_size}"
            )
        self._bytes = TokenBytes(self._tok, _byte_scheme(spec.get("decoder")))
        self._marker = _space_marker(spec.get("pre_tokenizer")) or _decoded_space(
            spec.get("decoder")
        )
        self._eos = config.eos_token_ids[0]
        self._stops = frozenset(config.eos_token_ids)

    def split_special_tokens(self) -> None:
        """At load, when tokenizer_config.json asks: special tokens in a text are plain text."""
        self._tok.encode_special_tokens = True

    def add_stop_ids(self, ids: Sequence[int]) -> None:
        """At load: end ids named outside config.json (see `load_tokenizer`)."""
        self._stops = self._stops | frozenset(ids)

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def stop_ids(self) -> frozenset[int]:
        return self._stops

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def rust(self) -> RustTokenizer:
        """The `tokenizers` object itself (the grammar backend reads its vocabulary)."""
        return self._tok

    def textless(self, token_id: int) -> bool:
        """A special token, or an id with no token: decode gives it no text."""
        return self._bytes.textless(token_id)

    def token_id(self, text: str) -> int | None:
        token_id = self._tok.token_to_id(text)
        return None if token_id is None else int(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for: one byte for a ``<0xNN>`` piece or a byte-level
        character, where decoding it alone would give U+FFFD; none for specials."""
        if self._bytes.scheme is None:
            return self.decode([token_id]).encode("utf-8")
        return self._bytes.of(token_id)

    def token_text(self, token_id: int) -> str:
        """A token's own text, as vLLM reports it in logprobs (``convert_ids_list_to_tokens``):
        decoded alone, with the leading spaces its ``▁`` markers stand for put back (decoding
        ``▁Hello`` alone strips the space the decoder takes for the prompt's own), whether the
        marker comes from a Metaspace pre-tokenizer or, as in TinyLlama's and Mistral v0.1's
        tokenizer.json, from a normalizer (the decoder then maps it back to a space)."""
        text = self.decode([token_id])
        if self._marker is None:
            return text
        piece = self._tok.id_to_token(token_id) or ""
        markers = len(piece) - len(piece.lstrip(self._marker))
        missing = markers - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def stream_decoder(self, prompt_ids: Sequence[int] = ()) -> HFStreamDecoder:
        return HFStreamDecoder(self.decode, self._bytes, prompt_ids)


def _byte_scheme(decoder: Any) -> str | None:
    """Which byte scheme the decoder applies: byte-level BPE, <0xNN> byte fallback, or none."""
    if not isinstance(decoder, dict):
        return None
    kind = decoder.get("type")
    if kind == "ByteLevel":
        return "byte_level"
    if kind == "ByteFallback":
        return "byte_fallback"
    if kind == "Sequence":
        schemes = {_byte_scheme(d) for d in decoder.get("decoders", [])} - {None}
        return schemes.pop() if len(schemes) == 1 else None
    return None


def _space_marker(pre_tokenizer: Any) -> str | None:
    """The character a Metaspace pre-tokenizer writes for a space (``▁``), or None."""
    if not isinstance(pre_tokenizer, dict):
        return None
    if pre_tokenizer.get("type") == "Metaspace":
        return str(pre_tokenizer.get("replacement", "▁"))
    if pre_tokenizer.get("type") == "Sequence":
        found = [_space_marker(p) for p in pre_tokenizer.get("pretokenizers", [])]
        return next((m for m in found if m is not None), None)
    return None


def _decoded_space(decoder: Any) -> str | None:
    """The character a decoder replaces by a space (``▁``, where a normalizer wrote it), or
    None."""
    if not isinstance(decoder, dict):
        return None
    if decoder.get("type") == "Replace" and decoder.get("content") == " ":
        pattern = decoder.get("pattern")
        found = pattern.get("String") if isinstance(pattern, dict) else None
        return found if isinstance(found, str) and len(found) == 1 else None
    if decoder.get("type") == "Sequence":
        found = [_decoded_space(d) for d in decoder.get("decoders", [])]
        return next((m for m in found if m is not None), None)
    return None


def load_tokenizer(checkpoint_dir: Path | str, config: ModelConfig) -> Tokenizer:
    """The tokenizer `config` asks for; refuses a byte model whose ids disagree with 256/257."""
    if config.kvguard_tokenizer == BYTE_TOKENIZER:
        _check_byte_config(Path(checkpoint_dir) / CONFIG_FILE, config)
        return ByteTokenizer()
    path = Path(checkpoint_dir) / TOKENIZER_FILE
    if path.is_symlink() and not path.exists():
        raise CheckpointError(path, "is a link to a missing file (an incomplete download?)")
    if not path.is_file():
        raise CheckpointError(path, "file is missing (and config.json sets no kvguard_tokenizer)")
    tokenizer = HFTokenizer(path, config)
    tokenizer.add_stop_ids(generation_eos_ids(checkpoint_dir, config.vocab_size))
    files = TokenizerFiles.read(checkpoint_dir)
    if files.split_special_tokens:
        tokenizer.split_special_tokens()
    eos_text = files.special_tokens.get("eos_token")
    if eos_text is not None:
        eos = tokenizer.token_id(eos_text)
        if eos is None:
            raise CheckpointError(
                Path(checkpoint_dir) / TOKENIZER_CONFIG_FILE,
                f"field 'eos_token': {eos_text!r} is not a token of {TOKENIZER_FILE}",
            )
        tokenizer.add_stop_ids([eos])
    return tokenizer


def _check_byte_config(path: Path, config: ModelConfig) -> None:
    if config.vocab_size < BYTE_VOCAB_SIZE:
        raise CheckpointError(
            path, f"field 'vocab_size': the byte tokenizer needs >= {BYTE_VOCAB_SIZE}"
        )
    if config.bos_token_id not in (None, BYTE_BOS):
        raise CheckpointError(path, f"field 'bos_token_id': the byte tokenizer's BOS is {BYTE_BOS}")
    if BYTE_EOS not in config.eos_token_ids:
        raise CheckpointError(path, f"field 'eos_token_id': the byte tokenizer's EOS is {BYTE_EOS}")
