"""Marker codec: wire format, verification, forgery resistance, key rotation."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from canary.markers import (
    MARKER_CHARS,
    MarkerCodec,
    MarkerKeyError,
    MarkerKeyring,
    decode_tag,
    encode_tag,
)

KEY_1 = bytes(range(32))
KEY_2 = bytes(range(100, 140))
ATTACKER_KEY = b"attacker-chosen-key-of-32-bytes!"
B32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
SHAPE = re.compile(r"CNRY-[A-Z2-7]{32}")


def make_codec() -> MarkerCodec:
    return MarkerCodec(MarkerKeyring({1: KEY_1}, current=1))


def payload_of(text: str) -> bytes:
    return base64.b32decode(text[5:])


def text_of(payload: bytes) -> str:
    return "CNRY-" + base64.b32encode(payload).decode()


def test_issued_marker_matches_the_specified_bytes_exactly() -> None:
    # Recomputed here from the spec, not from the codec, so a codec drift fails this test.
    nonce = bytes.fromhex("0102030405060708")
    marker = make_codec().issue("tenant-a", nonce=nonce)
    tag = hmac.new(KEY_1, b"kvguard-tenant:tenant-a", hashlib.sha256).digest()[:5]
    mac = hmac.new(KEY_1, b"kvguard-marker:" + tag + b"\x01" + nonce, hashlib.sha256).digest()[:6]
    assert marker.text == text_of(tag + b"\x01" + nonce + mac)
    assert (marker.tenant_tag, marker.key_id, marker.nonce) == (tag, 1, nonce)
    assert len(marker.text) == MARKER_CHARS == 37
    assert SHAPE.fullmatch(marker.text)
    assert marker.text[5:13] == encode_tag(tag)


def test_round_trip_parse_and_verify() -> None:
    codec = make_codec()
    marker = codec.issue("tenant-a")
    parsed = codec.parse(marker.text)
    verified = codec.verify(marker.text)
    assert parsed is not None and verified is not None
    assert parsed.tenant_tag == verified.tenant_tag == codec.tenant_tag("tenant-a")
    assert parsed.key_id == verified.key_id == 1
    assert parsed.nonce == verified.nonce == marker.nonce
    assert parsed.mac == payload_of(marker.text)[14:]


def test_reprs_show_no_marker_text_nonce_or_key() -> None:
    codec = make_codec()
    marker = codec.issue("tenant-a")
    parsed, verified = codec.parse(marker.text), codec.verify(marker.text)
    for obj in (marker, parsed, verified):
        shown = repr(obj) + str(obj)
        assert marker.text[5:] not in shown and marker.text[5:13] not in shown
        assert marker.nonce.hex() not in shown and repr(marker.nonce) not in shown
        assert marker.tenant_tag.hex() in shown
    assert KEY_1.hex() not in repr(codec.keyring) and repr(KEY_1) not in repr(codec)


def test_one_hundred_thousand_markers_do_not_collide_and_all_verify() -> None:
    codec = make_codec()
    texts = [codec.issue("tenant-a").text for _ in range(100_000)]
    assert len(set(texts)) == 100_000
    assert sum(codec.verify(t) is not None for t in texts[::100]) == 1_000


def test_tenant_tags_do_not_collide_across_ten_thousand_tenants() -> None:
    codec = MarkerCodec(MarkerKeyring({1: KEY_1, 2: KEY_2}, current=2))
    index = codec.tag_index(f"tenant-{i}" for i in range(10_000))
    assert len(index) == 20_000  # 10k tenants x 2 key ids, all distinct
    assert index[codec.tenant_tag("tenant-42", key_id=1)] == "tenant-42"
    assert index[codec.tenant_tag("tenant-42", key_id=2)] == "tenant-42"


def test_every_single_bit_flip_is_rejected() -> None:
    codec = make_codec()
    marker = codec.issue("tenant-a")
    payload = payload_of(marker.text)
    for bit in range(len(payload) * 8):
        flipped = bytearray(payload)
        flipped[bit // 8] ^= 1 << (bit % 8)
        text = text_of(bytes(flipped))
        assert codec.parse(text) is not None, bit  # still well-formed
        assert codec.verify(text) is None, bit


def test_every_single_character_substitution_is_rejected() -> None:
    codec = make_codec()
    marker = codec.issue("tenant-a")
    for i in range(5, MARKER_CHARS):
        for ch in B32.replace(marker.text[i], ""):
            assert codec.verify(marker.text[:i] + ch + marker.text[i + 1 :]) is None, (i, ch)


def test_a_tenant_cannot_frame_another_by_swapping_in_its_tag() -> None:
    # The attacker holds a genuine marker of its own and knows the victim's tag.
    codec = make_codec()
    own = payload_of(codec.issue("attacker").text)
    victim_tag = codec.tenant_tag("victim")
    assert codec.verify(text_of(victim_tag + own[5:])) is None
    # ...or signs the victim's tag with a key of its own choosing.
    nonce = bytes(8)
    fake_mac = hmac.new(
        ATTACKER_KEY, b"kvguard-marker:" + victim_tag + b"\x01" + nonce, hashlib.sha256
    ).digest()[:6]
    assert codec.verify(text_of(victim_tag + b"\x01" + nonce + fake_mac)) is None


@given(mac=st.binary(min_size=6, max_size=6), nonce=st.binary(min_size=8, max_size=8))
def test_guessed_macs_for_a_victim_tag_are_rejected(mac: bytes, nonce: bytes) -> None:
    codec = make_codec()
    real = codec.issue("victim", nonce=nonce)
    if payload_of(real.text)[14:] == mac:
        return  # the one correct guess (probability 2**-48) is not a forgery
    assert codec.verify(text_of(codec.tenant_tag("victim") + b"\x01" + nonce + mac)) is None


def test_wrong_or_unknown_key_id_is_rejected() -> None:
    codec = MarkerCodec(MarkerKeyring({1: KEY_1, 2: KEY_2}, current=1))
    payload = payload_of(codec.issue("tenant-a").text)
    assert codec.verify(text_of(payload[:5] + b"\x02" + payload[6:])) is None  # other real key
    assert codec.verify(text_of(payload[:5] + b"\x07" + payload[6:])) is None  # unknown key


def test_truncated_extended_and_altered_texts_are_not_markers() -> None:
    codec = make_codec()
    text = codec.issue("tenant-a").text
    for n in range(MARKER_CHARS):
        assert codec.parse(text[:n]) is None and codec.verify(text[:n]) is None, n
    for bad in (
        text + "A",
        " " + text,
        text + "\n",
        text.lower(),
        "CNRX-" + text[5:],
        "cnry-" + text[5:],
        text[:-1] + "=",
        text[:-1] + "1",
    ):
        assert codec.parse(bad) is None and codec.verify(bad) is None, bad


@given(body=st.text(alphabet=B32, min_size=32, max_size=32))
def test_every_well_formed_text_has_exactly_one_payload(body: str) -> None:
    # 32 base32 chars are exactly 160 bits: no padding or spare bits an attacker could vary.
    parsed = make_codec().parse("CNRY-" + body)
    assert parsed is not None
    payload = parsed.tenant_tag + bytes((parsed.key_id,)) + parsed.nonce + parsed.mac
    assert text_of(payload) == "CNRY-" + body


@given(tag=st.binary(min_size=5, max_size=5))
def test_tag_encoding_round_trips_through_the_first_eight_characters(tag: bytes) -> None:
    assert decode_tag(encode_tag(tag)) == tag
    assert len(encode_tag(tag)) == 8


def test_decode_tag_refuses_non_base32() -> None:
    assert decode_tag("ABCDEFG") is None
    assert decode_tag("ABCDEFG1") is None
    assert decode_tag("abcdefgh") is None


def test_rotation_issues_with_the_new_key_and_old_markers_still_verify() -> None:
    old_ring = MarkerKeyring({1: KEY_1}, current=1)
    old_codec = MarkerCodec(old_ring)
    old_marker = old_codec.issue("tenant-a")
    new_ring = old_ring.rotate(2, KEY_2)
    new_codec = MarkerCodec(new_ring)
    new_marker = new_codec.issue("tenant-a")

    assert (new_ring.current_id, new_ring.key_ids) == (2, (1, 2))
    assert (old_ring.current_id, old_ring.key_ids) == (1, (1,))  # rotate does not mutate
    assert new_marker.key_id == 2 and new_marker.tenant_tag == new_codec.tenant_tag("tenant-a")
    assert new_codec.tenant_tag("tenant-a") != new_codec.tenant_tag("tenant-a", key_id=1)
    assert new_codec.tenant_tags("tenant-a") == {
        new_codec.tenant_tag("tenant-a", key_id=1),
        new_codec.tenant_tag("tenant-a", key_id=2),
    }
    verified_old = new_codec.verify(old_marker.text)
    assert verified_old is not None and verified_old.key_id == 1
    assert old_codec.verify(new_marker.text) is None  # key 2 unknown to the old ring

    retired = MarkerCodec(MarkerKeyring({2: KEY_2}, current=2))
    assert retired.verify(old_marker.text) is None
    assert retired.verify(new_marker.text) is not None


def test_keyring_refuses_bad_keys_and_ids() -> None:
    with pytest.raises(MarkerKeyError):
        MarkerKeyring({1: b"x" * 31}, current=1)
    with pytest.raises(MarkerKeyError):
        MarkerKeyring({256: KEY_1}, current=256)
    with pytest.raises(MarkerKeyError):
        MarkerKeyring({-1: KEY_1}, current=-1)
    with pytest.raises(MarkerKeyError):
        MarkerKeyring({1: KEY_1}, current=2)
    ring = MarkerKeyring({1: KEY_1}, current=1)
    with pytest.raises(MarkerKeyError):
        ring.rotate(1, KEY_2)  # reusing an id would orphan its markers
    with pytest.raises(MarkerKeyError):
        ring.rotate(2, b"short")
    with pytest.raises(MarkerKeyError):
        MarkerCodec(ring).tenant_tag("tenant-a", key_id=9)


def test_issue_refuses_bad_nonce_and_empty_tenant() -> None:
    codec = make_codec()
    with pytest.raises(ValueError):
        codec.issue("tenant-a", nonce=b"1234567")
    with pytest.raises(ValueError):
        codec.issue("")


def test_seeded_nonce_is_deterministic_and_tenant_specific() -> None:
    codec = make_codec()
    nonce = b"\x00" * 8
    assert codec.issue("tenant-a", nonce=nonce).text == codec.issue("tenant-a", nonce=nonce).text
    assert codec.issue("tenant-a", nonce=nonce).text != codec.issue("tenant-b", nonce=nonce).text


def test_tag_index_refuses_a_real_collision() -> None:
    # A genuine 40-bit tag collision under KEY_1, found once by a birthday search (~1.2M ids).
    codec = make_codec()
    assert (
        codec.tenant_tag("t823537") == codec.tenant_tag("t1180287") == bytes.fromhex("46a6c35844")
    )
    with pytest.raises(ValueError, match="collision"):
        codec.tag_index(["t823537", "t1180287"])
