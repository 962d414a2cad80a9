"""Carried markers: a marker the client itself sent comes back as it is (never its own injected
marker, never another request's)."""

from __future__ import annotations

from canary.kinds import FindingKind
from canary.markers import MarkerCodec, MarkerKeyring
from canary.scanner import StreamScanner

CODEC = MarkerCodec(MarkerKeyring({1: bytes(range(32))}, current=1))
INJECTED = CODEC.issue("acme", nonce=b"inject01")
CARRIED = CODEC.issue("acme", nonce=b"carried1")
OTHER = CODEC.issue("acme", nonce=b"other--1")


def scan(text: str, split: int) -> tuple[str, list, bool]:
    scanner = StreamScanner(
        CODEC, owner_tenant_id="acme", own_nonces={INJECTED.nonce}, carried_nonces={CARRIED.nonce}
    )
    out, findings = [], []
    for chunk in (text[:split], text[split:]):
        result = scanner.feed(chunk)
        out.append(result.text)
        findings += result.findings
        if result.cut:
            return "".join(out), findings, True
    result = scanner.finish()
    return "".join(out) + result.text, findings + list(result.findings), result.cut


def test_carried_marker_is_delivered_injected_stripped_at_every_split() -> None:
    text = f"A {CARRIED.text} B {INJECTED.text} C"
    for split in range(len(text) + 1):
        assert scan(text, split) == (f"A {CARRIED.text} B  C", [], False), split


def test_another_request_of_the_same_tenant_is_still_a_finding() -> None:
    text = f"A {CARRIED.text} B {OTHER.text}"
    for split in range(len(text) + 1):
        delivered, findings, cut = scan(text, split)
        assert cut and delivered == f"A {CARRIED.text} B "
        assert [f.kind for f in findings] == [FindingKind.CROSS_REQUEST]


def test_a_nonce_that_is_both_own_and_carried_is_stripped() -> None:
    scanner = StreamScanner(
        CODEC, owner_tenant_id="acme", own_nonces={CARRIED.nonce}, carried_nonces={CARRIED.nonce}
    )
    assert scanner.feed(f"x{CARRIED.text}y").text + scanner.finish().text == "xy"
