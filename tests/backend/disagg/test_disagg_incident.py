"""The incident, reproduced with real processes and real Mooncake TCP transfers -- and each defence
shown to stop it on its own.

Configuration throughout (the incident's): the advertised window (384 tokens) is larger than the
prefill role's real pool (128 tokens; start-up allowed only with --allow-capacity-drift). Tenant A
sends a 100-token prompt, then tenant B a 304-token prompt: B fits decode's pool (384) but not
prefill's. Decode hands out free pages first-in first-out from a pool of 24: A gets pages 0-6, B
gets 7-23 and then A's freed 0-2, so B's last two (full) prompt pages are A's first two, and a B
that is wrongly served reads A's stale KV there. Until the bundled model exists, "reads" is
shown by page fingerprints in decode's drill read log (content hashes, never content).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from disagg_harness import (
    PAGE,
    Role,
    capacity,
    complete,
    decode,
    faults,
    kv_reads,
    metric,
    prefill,
    prompt_of,
    running,
)

A_TOKENS, B_TOKENS, MAX_TOKENS = 100, 304, 8
SKIP_ALL = ("skip_transfer_check", "skip_generation_check", "skip_checksum")
MISCONFIGURED = {"pool_tokens": 128, "context_window": 384, "allow_capacity_drift": True}
DECODE_POOL = {"pool_tokens": 384, "context_window": 384}

P_LEGACY = prefill(faults("legacy_reject_handoff"), allow_fault_drills=True, **MISCONFIGURED)
P_FIXED = prefill(allow_fault_drills=True, **MISCONFIGURED)


def _decode(of: Role, *names: str) -> Role:
    return decode(of, faults(*names), allow_fault_drills=True, **DECODE_POOL)


# Every defence switched off: the incident.
D_INCIDENT = _decode(P_LEGACY, "legacy_reject_handoff", *SKIP_ALL, "no_zero_on_free")
# Faults off, same misconfiguration.
D_FIXED = _decode(P_FIXED)
# Exactly one defence on (zeroing stays off so that a leak would show).
ALONE = {
    "cross_role_admission": _decode(P_LEGACY, *SKIP_ALL, "no_zero_on_free"),
    "explicit_outcome": _decode(P_FIXED, "legacy_reject_handoff", *SKIP_ALL, "no_zero_on_free"),
    "transfer_range": _decode(
        P_LEGACY,
        "legacy_reject_handoff",
        "skip_generation_check",
        "skip_checksum",
        "no_zero_on_free",
    ),
    "page_generations": _decode(
        P_LEGACY, "legacy_reject_handoff", "skip_transfer_check", "skip_checksum", "no_zero_on_free"
    ),
    "checksum": _decode(
        P_LEGACY,
        "legacy_reject_handoff",
        "skip_transfer_check",
        "skip_generation_check",
        "no_zero_on_free",
    ),
}
D_ZERO_ONLY = _decode(P_LEGACY, "legacy_reject_handoff", *SKIP_ALL)


@pytest.fixture(scope="module", autouse=True)
def processes(tiny_checkpoint: str) -> Iterator[None]:
    roles = [P_LEGACY, P_FIXED, D_INCIDENT, D_FIXED, D_ZERO_ONLY, *ALONE.values()]
    with running(tiny_checkpoint, *roles):
        yield


def _a_then_b(role: Role) -> tuple[Any, Any]:
    a = complete(
        role, prompt_of(A_TOKENS, "a"), max_tokens=MAX_TOKENS, request_id="req-a", tenant="tenant-a"
    )
    assert a.status_code == 200, a.text
    assert a.json()["kvguard"]["handoff"]["outcome"] == "ok"
    b = complete(
        role, prompt_of(B_TOKENS, "b"), max_tokens=MAX_TOKENS, request_id="req-b", tenant="tenant-b"
    )
    return a, b


def _stale_pages_read(role: Role) -> dict[int, str]:
    """Pages B read that still held A's prompt KV exactly as A's handoff delivered it."""
    reads = kv_reads(role)
    a_pages = {p["page_id"]: p["at_accept"] for p in reads["req-a"]["pages"][: A_TOKENS // PAGE]}
    return {
        p["page_id"]: p["at_accept"]
        for p in reads["req-b"]["pages"]
        if a_pages.get(p["page_id"]) == p["at_accept"]
    }


def test_incident_reproduced_b_gets_200_and_reads_a_stale_pages() -> None:
    _, b = _a_then_b(D_INCIDENT)
    assert b.status_code == 200, b.text
    body = b.json()
    assert body["usage"]["prompt_tokens"] == B_TOKENS  # billed as if the prompt was computed
    proof = body["kvguard"]["handoff"]
    assert proof["outcome"] == "ok" and proof["accepted"] is True
    assert (proof["reserved_tokens"], proof["transferred_tokens"]) == (B_TOKENS, 1)
    assert sorted(proof["skipped_checks"]) == ["checksum", "page_generations", "transfer_range"]
    stale = _stale_pages_read(D_INCIDENT)
    assert set(stale) == {0, 1}, f"B should have read A's pages: {kv_reads(D_INCIDENT)['req-b']}"
    # Prefill wrote one placeholder page; decode read all 19 prompt pages anyway.
    assert len(kv_reads(D_INCIDENT)["req-b"]["pages"]) == -(-B_TOKENS // PAGE)
    assert metric(D_INCIDENT, "kvguard_engine_handoff_transfer_mismatch_total") == 1
    cap = capacity(D_INCIDENT)
    assert "legacy_reject_handoff" in cap["faults"] and "skip_checksum" in cap["faults"]
    assert cap["drift"] is not None and "prefill" in cap["drift"]


def test_faults_off_b_gets_400_and_decode_reads_nothing() -> None:
    cap = capacity(D_FIXED)
    assert cap["max_request_tokens"] == 128  # the pair's real limit, not decode's 384
    assert {r["role"]: r["pool_tokens"] for r in cap["roles"]} == {"decode": 384, "prefill": 128}
    prefill_handoffs = metric(P_FIXED, "kvguard_engine_handoffs_total", outcome="ok")
    _, b = _a_then_b(D_FIXED)
    assert b.status_code == 400
    error = b.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert "maximum request length is 128 tokens" in error["message"]
    assert "req-b" not in kv_reads(D_FIXED)
    assert capacity(D_FIXED)["free_pages"] == 384 // PAGE
    # Refused before any page was reserved anywhere: prefill only ever saw A.
    assert metric(P_FIXED, "kvguard_engine_handoffs_total", outcome="ok") == prefill_handoffs + 1
    assert metric(P_FIXED, "kvguard_engine_handoffs_total", outcome="rejected") == 0


@pytest.mark.parametrize("defence", list(ALONE))
def test_each_defence_alone_stops_the_drill(defence: str) -> None:
    role = ALONE[defence]
    _, b = _a_then_b(role)
    assert b.status_code != 200, f"{defence} alone let B through: {b.text}"
    body = b.json()
    if defence in ("cross_role_admission", "explicit_outcome"):
        assert b.status_code == 400 and body["error"]["code"] == "context_length_exceeded"
        assert "maximum request length is 128 tokens" in body["error"]["message"]
    else:
        assert b.status_code == 502 and body["error"]["code"] == "kv_handoff_refused"
        assert body["kvguard"]["handoff"]["failed_check"] == defence
        assert metric(role, "kvguard_engine_handoff_refusals_total", check=defence) == 1
    assert "req-b" not in kv_reads(role)
    cap = capacity(role)
    assert (cap["free_pages"], cap["quarantined_pages"]) == (384 // PAGE, 0)


def test_zero_on_free_alone_answers_but_b_reads_no_stale_kv() -> None:
    """Zeroing does not stop the drill (B still gets a fluent 200) but A's KV is gone."""
    _, b = _a_then_b(D_ZERO_ONLY)
    assert b.status_code == 200
    assert _stale_pages_read(D_ZERO_ONLY) == {}
