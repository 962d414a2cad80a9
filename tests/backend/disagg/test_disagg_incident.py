"""The incident, reproduced with real processes and real Mooncake TCP transfers -- and each defence
shown to stop it on its own.

Configuration throughout (the incident's): the advertised window (512 tokens) is larger than the
prefill role's real pool (256 tokens; start-up allowed only with --allow-capacity-drift). Every role
runs the bundled model (``backend/bundled/kvguard-tiny``), which copies the canary marker it sees.

Tenant A sends a 200-token chat whose system message carries a marker MA (tokens 28-64) and whose
last user message is ``Repeat the reference code.``, with max_tokens 48, so it answers with MA.
Then tenant B sends a 400-token chat: it fits decode's pool (512) but not prefill's. Decode hands
out free pages first-in first-out from a pool of 32, on demand: A gets pages 0-12 for its prompt
and one more each time its answer starts a page (0-15 for a 41-token answer or longer), B's 25
prompt pages are the 16 nobody held, then A's freed pages from 0, so B's last eight or nine prompt
pages are A's pages 0-7 or 0-8 (A's tokens 0-127 at least, MA included). A B
that is wrongly served reads A's stale KV there -- shown by page fingerprints in decode's drill
read log (content hashes, never content) -- and the model turns it into text: B's answer holds MA.
This is the canary leak drill's recipe (``tests/canary/test_canary_leak_drill.py``) without the
gateway in front.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import pytest
from disagg_harness import (
    PAGE,
    Role,
    capacity,
    chat,
    chat_tokens,
    decode,
    faults,
    kv_reads,
    metric,
    prefill,
    running,
)

from backend.bundled.chat import REFERENCE_REQUEST
from backend.config import BUNDLED_MODEL_DIR

A_TOKENS, B_TOKENS, MAX_TOKENS = 200, 400, 48
PREFILL_POOL, DECODE_POOL_TOKENS = 256, 512
SKIP_ALL = ("skip_transfer_check", "skip_generation_check", "skip_checksum")
MISCONFIGURED = {"pool_tokens": PREFILL_POOL, "context_window": 512, "allow_capacity_drift": True}
DECODE_POOL = {"pool_tokens": DECODE_POOL_TOKENS, "context_window": 512}
# A fresh marker per run (CNRY- + 32 base32): B can hold it only by reading A's KV.
MA = "CNRY-" + "".join(secrets.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ234567") for _ in range(32))
# Enough of MA to attribute it: any 16 consecutive characters of MA hold at least 11 random base32
# characters (55 bits), never there by chance. The model usually copies all of MA; over stale KV
# that sits at other positions than it was written at it sometimes gets a character wrong, and a
# partial copy is already the leak.
LEAK_WINDOW = 16


def _holds_part_of(text: str, marker: str) -> bool:
    """Whether `text` carries LEAK_WINDOW consecutive characters of `marker`."""
    return any(marker[i : i + LEAK_WINDOW] in text for i in range(len(marker) - LEAK_WINDOW + 1))


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
def processes() -> Iterator[None]:
    roles = [P_LEGACY, P_FIXED, D_INCIDENT, D_FIXED, D_ZERO_ONLY, *ALONE.values()]
    with running(str(BUNDLED_MODEL_DIR), *roles):
        yield


def _a_chat() -> list[dict[str, str]]:
    """A's 200-token chat: MA in the system message, filler after it, then the reference ask."""
    head = f"Reference code: {MA} "
    messages = [
        {"role": "system", "content": head},
        {"role": "user", "content": REFERENCE_REQUEST},
    ]
    filler = "the quick brown fox jumps over the lazy dog " * 8
    messages[0]["content"] = head + filler[: A_TOKENS - chat_tokens(messages)]
    assert chat_tokens(messages) == A_TOKENS
    return messages


def _b_chat() -> list[dict[str, str]]:
    """B's 400-token chat: one user message of filler, no marker anywhere."""
    empty = chat_tokens([{"role": "user", "content": ""}])
    return [{"role": "user", "content": "x" * (B_TOKENS - empty)}]


def _text(response: httpx.Response) -> str:
    return str(response.json()["choices"][0]["message"]["content"])


def _a_then_b(role: Role) -> tuple[httpx.Response, httpx.Response]:
    a = chat(role, _a_chat(), max_tokens=MAX_TOKENS, request_id="req-a", tenant="tenant-a")
    assert a.status_code == 200, a.text
    assert a.json()["kvguard"]["handoff"]["outcome"] == "ok"
    assert MA in _text(a), "the bundled model no longer repeats the reference code"
    b = chat(role, _b_chat(), max_tokens=MAX_TOKENS, request_id="req-b", tenant="tenant-b")
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


def test_incident_reproduced_b_gets_200_with_a_marker_from_a_stale_pages() -> None:
    a, b = _a_then_b(D_INCIDENT)
    assert b.status_code == 200, b.text
    # The incident, at the text level: B's fluent answer carries A's marker.
    assert _holds_part_of(_text(b), MA), "B's answer does not hold A's marker"
    body = b.json()
    assert body["usage"]["prompt_tokens"] == B_TOKENS  # billed as if the prompt was computed
    proof = body["kvguard"]["handoff"]
    assert proof["outcome"] == "ok" and proof["accepted"] is True
    assert (proof["reserved_tokens"], proof["transferred_tokens"]) == (B_TOKENS, 1)
    assert sorted(proof["skipped_checks"]) == ["checksum", "page_generations", "transfer_range"]
    stale = _stale_pages_read(D_INCIDENT)
    # A's table at its end: its prompt and the answer's fed tokens (the last one never is).
    a_pages = -(-(A_TOKENS + a.json()["usage"]["completion_tokens"] - 1) // PAGE)
    b_from_a = -(-B_TOKENS // PAGE) - (DECODE_POOL_TOKENS // PAGE - a_pages)
    assert b_from_a in (8, 9)
    assert set(stale) == set(range(b_from_a)), f"B read A's pages: {kv_reads(D_INCIDENT)}"
    # Prefill wrote one placeholder page; decode read all 25 prompt pages anyway.
    assert len(kv_reads(D_INCIDENT)["req-b"]["pages"]) == -(-B_TOKENS // PAGE)
    assert metric(D_INCIDENT, "kvguard_engine_handoff_transfer_mismatch_total") == 1
    cap = capacity(D_INCIDENT)
    assert "legacy_reject_handoff" in cap["faults"] and "skip_checksum" in cap["faults"]
    assert cap["drift"] is not None and "prefill" in cap["drift"]
    # Every drill is loud: a metric per fault and an ERROR line at start-up, on each role.
    for role, fault in [(P_LEGACY, "legacy_reject_handoff"), *((D_INCIDENT, f) for f in SKIP_ALL)]:
        assert metric(role, "kvguard_engine_fault_drill_enabled", fault=fault) == 1
        assert f"FAULT DRILL ENABLED on the {role.role} role: {fault}" in role.log()


def test_faults_off_b_gets_400_and_decode_reads_nothing() -> None:
    cap = capacity(D_FIXED)
    assert cap["max_request_tokens"] == PREFILL_POOL  # the pair's real limit, not decode's 512
    pools = {r["role"]: r["pool_tokens"] for r in cap["roles"]}
    assert pools == {"decode": DECODE_POOL_TOKENS, "prefill": PREFILL_POOL}
    prefill_handoffs = metric(P_FIXED, "kvguard_engine_handoffs_total", outcome="ok")
    _, b = _a_then_b(D_FIXED)
    assert b.status_code == 400
    error = b.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert f"maximum request length is {PREFILL_POOL} tokens" in error["message"]
    assert "req-b" not in kv_reads(D_FIXED)
    assert capacity(D_FIXED)["free_pages"] == DECODE_POOL_TOKENS // PAGE
    # Refused before any page was reserved anywhere: prefill only ever saw A.
    assert metric(P_FIXED, "kvguard_engine_handoffs_total", outcome="ok") == prefill_handoffs + 1
    assert metric(P_FIXED, "kvguard_engine_handoffs_total", outcome="rejected") == 0
    # Drills allowed but none named: nothing announced (the control for the incident's checks).
    for role in (P_FIXED, D_FIXED):
        assert "kvguard_engine_fault_drill_enabled{" not in httpx.get(role.url + "/metrics").text
        assert "FAULT DRILL ENABLED" not in role.log()


@pytest.mark.parametrize("defence", list(ALONE))
def test_each_defence_alone_stops_the_drill(defence: str) -> None:
    role = ALONE[defence]
    _, b = _a_then_b(role)
    assert b.status_code != 200, f"{defence} alone let B through: {b.text}"
    body = b.json()
    if defence in ("cross_role_admission", "explicit_outcome"):
        assert b.status_code == 400 and body["error"]["code"] == "context_length_exceeded"
        assert f"maximum request length is {PREFILL_POOL} tokens" in body["error"]["message"]
    else:
        assert b.status_code == 502 and body["error"]["code"] == "kv_handoff_refused"
        assert body["kvguard"]["handoff"]["failed_check"] == defence
        assert metric(role, "kvguard_engine_handoff_refusals_total", check=defence) == 1
    assert "req-b" not in kv_reads(role)
    cap = capacity(role)
    assert (cap["free_pages"], cap["quarantined_pages"]) == (DECODE_POOL_TOKENS // PAGE, 0)


def test_zero_on_free_alone_answers_but_b_reads_no_stale_kv() -> None:
    """Zeroing does not stop the drill (B still gets a fluent 200) but A's KV is gone."""
    _, b = _a_then_b(D_ZERO_ONLY)
    assert b.status_code == 200
    assert _stale_pages_read(D_ZERO_ONLY) == {}
    assert not _holds_part_of(_text(b), MA)
