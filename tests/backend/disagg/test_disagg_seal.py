"""The seal on each transferred page: it opens only under its handoff's key, at its own position,
for its own page allocation; a changed byte, a replayed or moved chunk refuses; nonces are fresh.
"""

from __future__ import annotations

import pytest

from backend.disagg.protocol import PageGrant
from backend.disagg.seal import KEY_BYTES, NONCE_BYTES, OVERHEAD, TAG_BYTES, Binding, Seal, new_key

BINDING = Binding(3, "inst-1", "req-1.1", 40)
GRANT, NEXT = PageGrant(7, 2), PageGrant(8, 1)  # one chunk: a run of two pages
PLAIN = bytes(range(256)) * 4


def sealed(seal: Seal, binding: Binding = BINDING, position: int = 0) -> bytearray:
    out = bytearray(len(PLAIN) + OVERHEAD)
    aad = binding.associated_data(position, (GRANT, NEXT))
    seal.close_into(memoryview(PLAIN), aad, memoryview(out))
    return out


def opens(
    seal: Seal,
    chunk: bytes,
    binding: Binding = BINDING,
    position: int = 0,
    grants: tuple[PageGrant, ...] = (GRANT, NEXT),
) -> bool:
    out = bytearray(len(chunk) - OVERHEAD)
    aad = binding.associated_data(position, grants)
    ok = seal.open_into(memoryview(chunk), aad, memoryview(out))
    assert not ok or bytes(out) == PLAIN
    return ok


def test_a_sealed_chunk_opens_to_its_plaintext_and_hides_it() -> None:
    seal = Seal(new_key())
    chunk = sealed(seal)
    assert len(chunk) == len(PLAIN) + NONCE_BYTES + TAG_BYTES
    assert PLAIN[:64] not in chunk  # what the transfer port carries is not the KV
    assert opens(seal, bytes(chunk))


@pytest.mark.parametrize(
    ("binding", "position", "grants"),
    [
        (Binding(3, "inst-1", "req-2.1", 40), 0, (GRANT, NEXT)),  # another handoff
        (Binding(3, "inst-2", "req-1.1", 40), 0, (GRANT, NEXT)),  # another decode instance
        (Binding(3, "inst-1", "req-1.1", 41), 0, (GRANT, NEXT)),  # another prompt length
        (Binding(2, "inst-1", "req-1.1", 40), 0, (GRANT, NEXT)),  # another protocol version
        (BINDING, 1, (GRANT, NEXT)),  # another position of the prompt
        (BINDING, 0, (PageGrant(9, 2), NEXT)),  # another page
        (BINDING, 0, (PageGrant(7, 3), NEXT)),  # the same page, another allocation
        (BINDING, 0, (GRANT, PageGrant(8, 2))),  # a later page of the chunk, reallocated
        (BINDING, 0, (GRANT,)),  # fewer pages than it covers
    ],
    ids=[
        "handoff",
        "instance",
        "length",
        "version",
        "position",
        "page",
        "generation",
        "run-generation",
        "run-length",
    ],
)
def test_a_chunk_opens_only_where_it_was_sealed(
    binding: Binding, position: int, grants: tuple[PageGrant, ...]
) -> None:
    seal = Seal(new_key())
    assert not opens(seal, bytes(sealed(seal)), binding, position, grants)


def test_a_changed_byte_or_another_key_refuses() -> None:
    seal = Seal(new_key())
    chunk = sealed(seal)
    for index in (0, NONCE_BYTES, len(chunk) // 2, len(chunk) - 1):  # nonce, body, tag
        tampered = bytearray(chunk)
        tampered[index] ^= 0x01
        assert not opens(seal, bytes(tampered))
    assert not opens(Seal(new_key()), bytes(chunk))
    assert not opens(seal, bytes(len(chunk)))  # an unwritten (zero) slot


def test_keys_and_nonces_are_fresh() -> None:
    assert len({new_key() for _ in range(64)}) == 64 and len(new_key()) == KEY_BYTES
    seal = Seal(new_key())
    nonces = {bytes(sealed(seal)[:NONCE_BYTES]) for _ in range(256)}
    assert len(nonces) == 256  # sealing the same page twice never reuses a nonce
    with pytest.raises(ValueError, match="32 bytes"):
        Seal(b"short")
    assert "key" not in repr(seal).replace("<key>", "")  # no key material in a repr


def test_the_drills_unauthenticated_open_accepts_what_the_seal_refuses() -> None:
    """What ``skip_seal_check`` does: GCM's keystream without the tag. A genuine chunk decrypts
    the same; a flipped bit passes straight into the plaintext (malleable), where the seal
    refuses it."""
    seal = Seal(new_key())
    chunk = sealed(seal)
    out = bytearray(len(PLAIN))
    seal.open_unauthenticated(memoryview(bytes(chunk)), memoryview(out))
    assert bytes(out) == PLAIN
    chunk[NONCE_BYTES + 5] ^= 0x80
    seal.open_unauthenticated(memoryview(bytes(chunk)), memoryview(out))
    assert out[5] == PLAIN[5] ^ 0x80 and out[6:] == PLAIN[6:]
    assert not opens(seal, bytes(chunk))
