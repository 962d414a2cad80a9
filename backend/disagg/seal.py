"""The seal on every page of KV that crosses the transfer port: AES-256-GCM, one key per handoff.

Lifecycle of one handoff's key:

1. Decode draws a fresh 256-bit key when it reserves the pages (``new_key``) and sends it inside
   the PrefillRequest, over the handoff API that takes the engine credential -- never over the
   transfer port.
2. Prefill seals each chunk -- a run of consecutive pages of one transfer batch
   (``backend.disagg.channel.chunks``) -- with ``Seal.close_into``: a random 96-bit nonce, then
   the ciphertext, then the 16-byte tag, with associated data (``Binding.associated_data``)
   naming the protocol version, the decode instance, the handoff id, the prompt's length, the
   chunk's first position in the prompt and every page id and generation it covers. A chunk
   therefore opens only in its own handoff, at its own positions, for its own page allocations:
   bytes replayed from another handoff or moved elsewhere fail, and so does any byte changed.
3. Decode opens each chunk from its private copy of the landing slots (``Seal.open_into``) and
   forgets the key when the handoff ends.

Nonces: the key is never used for more than one handoff, and each chunk draws its own random
nonce, so a nonce repeats under a key only with probability about chunks^2 / 2^97 -- even if a
PrefillRequest were replayed (only a holder of the engine credential could, and it already holds
the key). AES-GCM over ChaCha20-Poly1305: 3-5x faster on CPUs with AES instructions; a chunk per
run of pages rather than per page: each call costs a few microseconds besides its bytes, which
outweighs small pages (``python -m bench.bench_handoff`` measures both). ``cryptography``
(OpenSSL) does the work; nothing here is ours but the framing.

``open_unauthenticated`` exists for the ``skip_seal_check`` drill only: it decrypts a chunk as
AES-CTR (GCM's keystream) without its tag, which is what an unauthenticated cipher would accept.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from backend.disagg.protocol import PageGrant

ALGORITHM = "aes-256-gcm"
KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD = NONCE_BYTES + TAG_BYTES  # a sealed chunk is this much longer than its plaintext
_FIRST_CTR_BLOCK = b"\x00\x00\x00\x02"  # GCM with a 96-bit nonce encrypts from counter 2


def new_key() -> bytes:
    """A fresh key for one handoff."""
    return AESGCM.generate_key(bit_length=8 * KEY_BYTES)


@dataclass(frozen=True, slots=True)
class Binding:
    """What a sealed chunk is bound to besides its position: the handoff it belongs to."""

    protocol_version: int
    instance_id: str
    handoff_id: str
    n_tokens: int

    def associated_data(self, first: int, grants: Sequence[PageGrant]) -> bytes:
        """For the chunk of the prompt's pages ``first, first + 1, ...`` granted as ``grants``."""
        pages = ",".join(f"{g.page_id}@{g.generation}" for g in grants)
        return (
            f"kvguard-kv/{self.protocol_version}/{self.instance_id}/{self.handoff_id}/"
            f"{self.n_tokens}/{first}/{pages}"
        ).encode()


class Seal:
    """One handoff's key, for sealing (prefill) or opening (decode) its chunks."""

    __slots__ = ("_aead", "_key")

    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a seal key is {KEY_BYTES} bytes, not {len(key)}")
        self._key = key
        self._aead = AESGCM(key)

    def __repr__(self) -> str:
        return "Seal(<key>)"

    def close_into(self, plain: memoryview, associated: bytes, out: memoryview) -> None:
        """Seal ``plain`` into ``out`` (``len(plain) + OVERHEAD`` bytes): nonce, ciphertext, tag."""
        nonce = os.urandom(NONCE_BYTES)
        out[:NONCE_BYTES] = nonce
        self._aead.encrypt_into(nonce, plain, associated, out[NONCE_BYTES:])

    def open_into(self, sealed: memoryview, associated: bytes, out: memoryview) -> bool:
        """Authenticate and decrypt ``sealed`` into ``out``; False if it is not this handoff's
        chunk for this position (``out`` then holds nothing to use)."""
        nonce = bytes(sealed[:NONCE_BYTES])
        try:
            self._aead.decrypt_into(nonce, sealed[NONCE_BYTES:], associated, out)
        except InvalidTag:
            return False
        return True

    def open_unauthenticated(self, sealed: memoryview, out: memoryview) -> None:
        """The ``skip_seal_check`` drill: decrypt without checking the tag (never otherwise)."""
        nonce = bytes(sealed[:NONCE_BYTES])
        keystream = Cipher(algorithms.AES(self._key), modes.CTR(nonce + _FIRST_CTR_BLOCK))
        decryptor = keystream.decryptor()
        out[:] = decryptor.update(sealed[NONCE_BYTES:-TAG_BYTES]) + decryptor.finalize()
