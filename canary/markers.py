"""Canary marker codec: issue, parse and verify unforgeable, self-describing markers.

Lifecycle of a marker:

1. ``MarkerCodec.issue(tenant_id)`` builds one for a request with the keyring's current key.
   The gateway injects ``Marker.text`` into the request and keeps ``Marker.nonce`` as that
   request's own nonce.
2. Any text can be scanned (``canary.scanner``): ``parse`` is the syntactic check,
   ``verify`` the cryptographic one. A verified marker names its tenant (by tag), the key id
   and the request nonce without any lookup.
3. Keys rotate by ``MarkerKeyring.rotate``: the new key id issues, older ids still verify until
   they are dropped from the configured keyring.

Wire format (fixed: the bundled model is trained on this shape)::

    CNRY-<32 chars of RFC 4648 base32, A-Z2-7, no padding>  ->  20-byte payload
    tenant_tag (5) | key_id (1) | nonce (8) | mac (6)

    tenant_tag = HMAC-SHA256(key, b"kvguard-tenant:" + tenant_id)[:5]
    mac        = HMAC-SHA256(key, b"kvguard-marker:" + tenant_tag + key_id + nonce)[:6]

20 bytes are exactly 160 bits = 32 base32 characters, and the 5-byte tag exactly the first 8
characters, so every marker text has one payload (no padding or spare-bit malleability) and a
truncated marker still shows its owner's whole tag. The key id follows, then the nonce: 23 body
characters (115 bits) carry tag, key id and nonce (``decode_visible``), enough to find a truncated
copy's issue record; only the MAC needs all 32.

Security notes: a forged marker needs the key; a blind guess passes the 48-bit MAC with
probability 2**-48, and a valid marker only ever names the tag it was issued for. Tags are per
key and no tenant receives a whole one: the scanner strips a tenant's own markers and cuts the
stream before a foreign one. In a response's text no character of a foreign marker is delivered;
in a side field that cannot be held back (an id, a key, an extension field) at most ``PREFIX`` and
``TAG_CHARS - 1`` body characters of it are (``gateway/proxy/side.py``), never a whole tag. A
request carrying ``PREFIX`` and another tenant's tag is refused (``canary.injection``), so a tenant
cannot even aim a damaged-copy "suspected" finding at another tenant. Tags are 40 bits:
``tag_index`` refuses the rare collision instead of misattributing. Anything holding marker text
or secrets has a redacting repr.
"""

from __future__ import annotations

import base64
import functools
import hmac
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

PREFIX = "CNRY-"
BODY_CHARS = 32
MARKER_CHARS = len(PREFIX) + BODY_CHARS
TAG_BYTES = 5
TAG_CHARS = 8
KEY_ID_BYTES = 1
NONCE_BYTES = 8
MAC_BYTES = 6
PAYLOAD_BYTES = TAG_BYTES + KEY_ID_BYTES + NONCE_BYTES + MAC_BYTES
KEY_ID_CHARS = -(-(TAG_BYTES + KEY_ID_BYTES) * 8 // 5)  # 10: body characters that show the key id
NONCE_CHARS = -(-(TAG_BYTES + KEY_ID_BYTES + NONCE_BYTES) * 8 // 5)  # 23: ... and the nonce
MIN_KEY_BYTES = 32
MAX_KEY_ID = 255
BASE32_CLASS = "[A-Z2-7]"

_TENANT_DOMAIN = b"kvguard-tenant:"
_MARKER_DOMAIN = b"kvguard-marker:"
_MARKER_RE = re.compile(re.escape(PREFIX) + BASE32_CLASS + "{" + str(BODY_CHARS) + "}")
_TAG_CHARS_RE = re.compile(BASE32_CLASS + "{" + str(TAG_CHARS) + "}")
_B32_RUN_RE = re.compile(BASE32_CLASS + "+")
_B32_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
_TO_INT_DIGITS = str.maketrans(_B32_ALPHABET, "0123456789ABCDEFGHIJKLMNOPQRSTUV")

assert PAYLOAD_BYTES * 8 == BODY_CHARS * 5, "payload must fill the base32 body exactly"
assert TAG_BYTES * 8 == TAG_CHARS * 5, "the tag must fill whole base32 characters"


class MarkerKeyError(ValueError):
    """A keyring was built or rotated with an unusable key or key id."""


class MarkerKeyring:
    """Marker secrets by key id (0-255), plus the id that issues new markers.

    Immutable: ``rotate`` returns a new keyring, so a scanner or codec built on one keyring
    never sees its keys change underneath it.
    """

    __slots__ = ("_current", "_keys")

    def __init__(self, keys: Mapping[int, bytes], *, current: int) -> None:
        for key_id, secret in keys.items():
            _check_key(key_id, secret)
        if current not in keys:
            raise MarkerKeyError(f"current key id {current} is not in the keyring")
        self._keys: Mapping[int, bytes] = MappingProxyType({k: bytes(v) for k, v in keys.items()})
        self._current = current

    @property
    def current_id(self) -> int:
        return self._current

    @property
    def key_ids(self) -> tuple[int, ...]:
        return tuple(sorted(self._keys))

    def get(self, key_id: int) -> bytes | None:
        return self._keys.get(key_id)

    def rotate(self, new_id: int, secret: bytes) -> MarkerKeyring:
        """A keyring where ``new_id`` issues and every existing id still verifies."""
        if new_id in self._keys:
            # Reusing an id would silently invalidate every marker issued under it.
            raise MarkerKeyError(f"key id {new_id} is already in the keyring")
        return MarkerKeyring({**self._keys, new_id: secret}, current=new_id)

    def __repr__(self) -> str:
        ids = list(self.key_ids)
        return f"MarkerKeyring(key_ids={ids}, current={self._current}, keys=<redacted>)"


def _check_key(key_id: int, secret: bytes) -> None:
    if not isinstance(key_id, int) or not 0 <= key_id <= MAX_KEY_ID:
        raise MarkerKeyError(f"key id must be an int in 0..{MAX_KEY_ID}, got {key_id!r}")
    if not isinstance(secret, bytes | bytearray):
        raise MarkerKeyError(f"key {key_id}: secret must be bytes")
    if len(secret) < MIN_KEY_BYTES:
        raise MarkerKeyError(f"key {key_id}: secret must be at least {MIN_KEY_BYTES} bytes")


@dataclass(frozen=True, slots=True)
class Marker:
    """A freshly issued marker. ``text`` is what gets injected; repr never shows it."""

    text: str = field(repr=False)
    tenant_tag: bytes
    key_id: int
    nonce: bytes = field(repr=False)

    def __repr__(self) -> str:
        return _redacted_repr("Marker", self.tenant_tag, self.key_id)


@dataclass(frozen=True, slots=True)
class ParsedMarker:
    """The fields of a syntactically valid marker; nothing about it is verified yet."""

    tenant_tag: bytes
    key_id: int
    nonce: bytes = field(repr=False)
    mac: bytes = field(repr=False)

    def __repr__(self) -> str:
        return _redacted_repr("ParsedMarker", self.tenant_tag, self.key_id)


@dataclass(frozen=True, slots=True)
class Verified:
    """A genuine marker: issued by this deployment's key ``key_id`` for ``tenant_tag``."""

    tenant_tag: bytes
    key_id: int
    nonce: bytes = field(repr=False)

    def __repr__(self) -> str:
        return _redacted_repr("Verified", self.tenant_tag, self.key_id)


def _redacted_repr(name: str, tag: bytes, key_id: int) -> str:
    # The tag (hex) says whose marker it is; text, nonce and MAC stay out of logs.
    return f"{name}(tenant_tag={tag.hex()}, key_id={key_id}, <redacted>)"


class MarkerCodec:
    """Issues and checks markers with the keys of one ``MarkerKeyring``. Pure: no I/O."""

    __slots__ = ("_keyring",)

    def __init__(self, keyring: MarkerKeyring) -> None:
        self._keyring = keyring

    @property
    def keyring(self) -> MarkerKeyring:
        return self._keyring

    def tenant_tag(self, tenant_id: str, *, key_id: int | None = None) -> bytes:
        """The tenant's 5-byte tag under ``key_id`` (default: the current key)."""
        kid = self._keyring.current_id if key_id is None else key_id
        key = self._keyring.get(kid)
        if key is None:
            raise MarkerKeyError(f"key id {kid} is not in the keyring")
        return _tag(key, tenant_id)

    def tenant_tags(self, tenant_id: str) -> frozenset[bytes]:
        """The tenant's tags under every key id that still verifies."""
        return frozenset(self.tenant_tag(tenant_id, key_id=k) for k in self._keyring.key_ids)

    def tag_index(self, tenant_ids: Iterable[str]) -> dict[bytes, str]:
        """tag -> tenant over every key id, for the scanner's ``known_tags``.

        Raises on a tag collision (about n**2 / 2**41 for n tenants) rather than misattribute.
        """
        index: dict[bytes, str] = {}
        for tenant_id in tenant_ids:
            for tag in self.tenant_tags(tenant_id):
                other = index.setdefault(tag, tenant_id)
                if other != tenant_id:
                    raise ValueError(f"tenant tag collision between {other!r} and {tenant_id!r}")
        return index

    def issue(
        self, tenant_id: str, *, nonce: bytes | None = None, key_id: int | None = None
    ) -> Marker:
        """A new marker for ``tenant_id`` under the current key. ``nonce`` and ``key_id`` rebuild
        a marker issued before (the scanner: a request's own markers) or fix one in tests."""
        if nonce is None:
            nonce = secrets.token_bytes(NONCE_BYTES)
        elif len(nonce) != NONCE_BYTES:
            raise ValueError(f"nonce must be {NONCE_BYTES} bytes")
        kid = self._keyring.current_id if key_id is None else key_id
        key = self._keyring.get(kid)
        if key is None:
            raise MarkerKeyError(f"key id {kid} is not in the keyring")
        tag = _tag(key, tenant_id)
        payload = tag + bytes((kid,)) + nonce + _mac(key, tag, kid, nonce)
        text = PREFIX + base64.b32encode(payload).decode("ascii")
        return Marker(text=text, tenant_tag=tag, key_id=kid, nonce=nonce)

    def body_of(self, tag: bytes, key_id: int, nonce: bytes) -> str | None:
        """The 32 body characters of the genuine marker with these fields (None: unknown key)."""
        key = self._keyring.get(key_id)
        if key is None:
            return None
        payload = tag + bytes((key_id,)) + nonce + _mac(key, tag, key_id, nonce)
        return base64.b32encode(payload).decode("ascii")

    def known_tags(self, tenant_ids: Iterable[str]) -> dict[str, KnownTag]:
        """tag text -> whose, over every key id (a tag two tenants share names nobody), for a
        scanner's ``known_tags`` (``canary.firewall.TagIndex`` keeps the gateway's)."""
        known: dict[str, KnownTag] = {}
        for tenant_id in tenant_ids:
            for key_id in self._keyring.key_ids:
                text = encode_tag(self.tenant_tag(tenant_id, key_id=key_id))
                entry = KnownTag(tenant=tenant_id, key_id=key_id)
                other = known.setdefault(text, entry)
                if other.tenant != tenant_id:
                    known[text] = KnownTag(tenant=None, key_id=key_id)
        return known

    def parse(self, text: str) -> ParsedMarker | None:
        """The fields of ``text`` if it is exactly one marker (syntax only), else None."""
        if _MARKER_RE.fullmatch(text) is None:
            return None
        payload = _b32decode(text[len(PREFIX) :], PAYLOAD_BYTES)
        t, k, n = TAG_BYTES, TAG_BYTES + KEY_ID_BYTES, TAG_BYTES + KEY_ID_BYTES + NONCE_BYTES
        return ParsedMarker(
            tenant_tag=payload[:t], key_id=payload[t], nonce=payload[k:n], mac=payload[n:]
        )

    def verify(self, marker_text: str) -> Verified | None:
        """The marker's tag, key id and nonce if it is genuine under a known key, else None."""
        parsed = self.parse(marker_text)
        if parsed is None:
            return None
        key = self._keyring.get(parsed.key_id)
        if key is None:
            return None
        expected = _mac(key, parsed.tenant_tag, parsed.key_id, parsed.nonce)
        if not hmac.compare_digest(expected, parsed.mac):
            return None
        return Verified(tenant_tag=parsed.tenant_tag, key_id=parsed.key_id, nonce=parsed.nonce)

    def verify_body(self, body: str) -> Verified | None:
        """``verify`` of the 32 body characters alone (a marker whose prefix was bent or lost)."""
        return self.verify(PREFIX + body)

    def __repr__(self) -> str:
        return f"MarkerCodec({self._keyring!r})"


def decode_tag(chars: str) -> bytes | None:
    """The tag carried by the first 8 body characters, or None if they are not base32."""
    if _TAG_CHARS_RE.fullmatch(chars) is None:
        return None
    return _b32decode(chars, TAG_BYTES)


@dataclass(frozen=True, slots=True)
class KnownTag:
    """Whose tag a tag text is: the tenant (None when two tenants share it) and the key id."""

    tenant: str | None
    key_id: int


@dataclass(frozen=True, slots=True)
class Visible:
    """What the leading body characters of a (possibly truncated) marker carry, unverified."""

    tenant_tag: bytes
    key_id: int | None
    nonce: bytes | None = field(repr=False)

    def __repr__(self) -> str:
        return f"Visible(tenant_tag={self.tenant_tag.hex()}, key_id={self.key_id}, <redacted>)"


def visible_key_id(chars: str) -> int | None:
    """The key id the leading body characters ``chars`` show (at least ``KEY_ID_CHARS``)."""
    visible = decode_visible(chars[:KEY_ID_CHARS]) if len(chars) >= KEY_ID_CHARS else None
    return None if visible is None else visible.key_id


def decode_visible(chars: str) -> Visible | None:
    """The tag, and the key id and nonce when enough characters show them, carried by the leading
    body characters ``chars`` of a marker (at least ``TAG_CHARS``); None if they are too few or
    not base32. Nothing is verified: a truncated marker has no MAC to check."""
    if len(chars) < TAG_CHARS or _B32_RUN_RE.fullmatch(chars) is None:
        return None
    chars = chars[:BODY_CHARS]
    size = len(chars) * 5 // 8
    bits = int(chars.translate(_TO_INT_DIGITS), 32) >> (len(chars) * 5 - size * 8)
    visible = bits.to_bytes(size, "big")
    k, n = TAG_BYTES + KEY_ID_BYTES, TAG_BYTES + KEY_ID_BYTES + NONCE_BYTES
    return Visible(
        tenant_tag=visible[:TAG_BYTES],
        key_id=visible[TAG_BYTES] if size >= k else None,
        nonce=visible[k:n] if size >= n else None,
    )


# Tenant tags and their texts are pure functions of (key, tenant) and (tag), asked for on every
# response whose scanner meets a marker: memoised (HMAC and base64's pure-Python base-32 were
# ~40% of scanning a chunk that holds a marker).
_TAG_CACHE = 4096


@functools.lru_cache(maxsize=_TAG_CACHE)
def encode_tag(tag: bytes) -> str:
    """The 8 body characters that carry ``tag`` (the inverse of ``decode_tag``)."""
    if len(tag) != TAG_BYTES:
        raise ValueError(f"a tenant tag is {TAG_BYTES} bytes")
    return base64.b32encode(tag).decode("ascii")


def _b32decode(chars: str, size: int) -> bytes:
    # The callers matched the A-Z2-7 alphabet and a length of exactly size * 8 / 5 characters.
    # base64.b32decode is pure Python and the scanner's hottest cost; a base-32 int is exact
    # here because the characters carry whole bytes (no padding bits).
    return int(chars.translate(_TO_INT_DIGITS), 32).to_bytes(size, "big")


@functools.lru_cache(maxsize=_TAG_CACHE)
def _tag(key: bytes, tenant_id: str) -> bytes:
    if not tenant_id:
        raise ValueError("tenant_id must be a non-empty string")
    return hmac.digest(key, _TENANT_DOMAIN + tenant_id.encode("utf-8"), "sha256")[:TAG_BYTES]


def _mac(key: bytes, tag: bytes, key_id: int, nonce: bytes) -> bytes:
    message = _MARKER_DOMAIN + tag + bytes((key_id,)) + nonce
    return hmac.digest(key, message, "sha256")[:MAC_BYTES]
