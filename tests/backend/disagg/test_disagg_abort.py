"""Aborts and crashes during a transfer: real processes, real Mooncake TCP transfers.

The prefill role simulates a slow link (a drill setting): each committed batch of KV spends
bytes / rate "on the wire" before it lands, and, like an RDMA write, cannot be recalled. A is a
long prompt whose first batch (8 pages) is in flight for 0.6 s; the client drops A mid-transfer.
B is a 2-token prompt with a long answer: its reservation needs every page of the pool (so only
A's pages can hold it), its own transfer takes ~10 ms, and it decodes for over a second.

On the sealed channel decode withdraws A's landing slots at the abort: the batch in flight meets
memory no longer registered and is refused, and prefill ends A as aborted. The early-release
drill runs on the open channel (decode's pages themselves registered, as before the seal), where
B is verified and decoding when A's batch lands on its first page: the hazard the quarantine
answers. (On the sealed channel a late write can only reach a landing slot, where a later
handoff's seal refuses it: ``tests/backend/verify``.)
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from disagg_harness import (
    MODEL,
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
    wait_for,
)

BATCH_PAGES = 8
PAGE_BYTES = 2 * 2 * PAGE * 2 * 16 * 4  # layers x (K, V) x tokens x kv heads x head dim x fp32
IN_FLIGHT_S = 0.6
LINK = {"KVGUARD_DRILL_LINK_BYTES_PER_S": str(int(BATCH_PAGES * PAGE_BYTES / IN_FLIGHT_S))}
POOL_PAGES = 95
A_PROMPT, A_MAX = 1510, 10  # the prompt's 95 pages (reserved for the handoff): the whole pool
B_PROMPT, B_MAX = 2, 1504  # its first page can only be one of A's
BATCH = {"KVGUARD_TRANSFER_BATCH_PAGES": str(BATCH_PAGES)}
DECODE = {"pool_tokens": POOL_PAGES * PAGE, "allow_fault_drills": True}

OPEN = {"KVGUARD_KV_CHANNEL": "open"}  # for prefill: it also serves open-channel decodes

P_SLOW = prefill({**LINK, **OPEN}, pool_tokens=2048, allow_fault_drills=True)
D_QUARANTINE = decode(P_SLOW, BATCH, **DECODE)
D_EARLY = decode(P_SLOW, {**BATCH, **OPEN, **faults("early_release_on_abort")}, **DECODE)
# R: a 1200-token prompt sent as one batch of 75 pages, ~5.6 s on P_SLOW's link, to a decode that
# is killed meanwhile. To prefill a restarted decode is a new instance (new instance id, new
# transfer endpoint) whatever its HTTP port, so the successor starts with the others: the old
# write is still in flight when it serves, however long a process start takes on a busy machine.
R_PROMPT, R_PAGES = 1200, 75
D_DOOMED = decode(
    P_SLOW,
    {"KVGUARD_TRANSFER_BATCH_PAGES": str(R_PAGES)},
    pool_tokens=1280,
    allow_fault_drills=True,
)
D_SUCCESSOR = decode(P_SLOW, pool_tokens=512, allow_fault_drills=True)
P_DOOMED = prefill(LINK, pool_tokens=512, allow_fault_drills=True)
D_ORPHANED = decode(
    P_DOOMED, {"KVGUARD_HANDOFF_TIMEOUT_S": "3"}, pool_tokens=512, allow_fault_drills=True
)


@pytest.fixture(scope="module", autouse=True)
def processes(tiny_checkpoint: str) -> Iterator[None]:
    roles = (P_SLOW, D_QUARANTINE, D_EARLY, D_DOOMED, D_SUCCESSOR, P_DOOMED, D_ORPHANED)
    with running(tiny_checkpoint, *roles):
        yield


def _transferring(prefill_role: Role) -> bool:
    return metric(prefill_role, "kvguard_engine_handoffs_active", state="transferring") >= 1


def _start_stream(role: Role, prompt: str, max_tokens: int, request_id: str) -> Any:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    headers = {"X-Kvguard-Request-Id": request_id}
    return httpx.stream(
        "POST", role.url + "/v1/completions", json=body, headers=headers, timeout=30
    )


def _drop_a_mid_transfer(role: Role) -> None:
    """Stream A, wait until prefill is writing its KV, then hang up."""
    with _start_stream(role, prompt_of(A_PROMPT, "a"), A_MAX, "req-a") as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # keep a reference: dropping it closes the connection
        next(lines)  # the first chunk: A is admitted, its pages reserved
        wait_for(lambda: _transferring(P_SLOW), 20, "prefill writing A's KV")
        del lines
    # Leaving the block closed the connection: decode aborts A while its first batch is in flight.


def _b_in_background(role: Role, out: dict[str, httpx.Response]) -> threading.Thread:
    def run() -> None:
        out["b"] = complete(role, prompt_of(B_PROMPT, "b"), max_tokens=B_MAX, request_id="req-b")

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_abort_mid_transfer_quarantines_until_prefill_confirms() -> None:
    aborted = metric(P_SLOW, "kvguard_engine_handoffs_total", outcome="aborted")
    _drop_a_mid_transfer(D_QUARANTINE)
    pool = POOL_PAGES
    cap = wait_for(
        lambda: (c := capacity(D_QUARANTINE))["quarantined_pages"] == pool and c,
        10,
        "A's pages quarantined",
    )
    assert cap["free_pages"] == 0
    out: dict[str, httpx.Response] = {}
    # B is sent once every page was seen quarantined. (That B got its page only after the drain
    # is proven below by generations, not by sampling the pool right after B starts: the
    # quarantine may end any moment, and such a sample raced with it on a loaded machine.)
    thread = _b_in_background(D_QUARANTINE, out)
    thread.join(30)
    b = out["b"]
    assert b.status_code == 200, b.text
    assert b.json()["kvguard"]["handoff"]["accepted"] is True
    # Released on prefill's word that no write is in flight (its abort ack, or its final result,
    # whichever came first), not on a timer.
    drained = {
        reason: metric(D_QUARANTINE, "kvguard_engine_drained_pages_total", release=reason)
        for reason in ("ack", "result", "timeout")
    }
    assert drained["ack"] + drained["result"] == pool and drained["timeout"] == 0
    # A's batch in flight met the withdrawn slots: refused, so prefill ended A aborted (its
    # result, or its ack first) and nothing of A's reached any page.
    wait_for(
        lambda: metric(P_SLOW, "kvguard_engine_handoffs_total", outcome="aborted") > aborted,
        10,
        "prefill's result for A",
    )
    assert metric(D_QUARANTINE, "kvguard_engine_quarantine_absorbed_write_pages_total") == 0
    # The control: nothing was released early, so nothing landed after a release.
    assert metric(D_QUARANTINE, "kvguard_engine_handoff_late_write_pages_total") == 0
    read = kv_reads(D_QUARANTINE)["req-b"]["pages"]
    # Generation 1 was A's; the drain bumped it to 2; B's allocation made it 3.
    assert [p["generation"] for p in read] == [3]
    # The late write landed during the quarantine: B's prompt KV was never touched after checks.
    assert metric(D_QUARANTINE, "kvguard_engine_pool_pages", state="quarantined") == 0
    assert read[0]["at_finish"] == read[0]["at_accept"]
    assert capacity(D_QUARANTINE)["quarantined_pages"] == 0


def test_early_release_on_abort_shows_the_hazard_is_real() -> None:
    _drop_a_mid_transfer(D_EARLY)
    out: dict[str, httpx.Response] = {}
    _b_in_background(D_EARLY, out).join(30)
    b = out["b"]
    # B was verified and answered 200 ...
    assert b.status_code == 200, b.text
    read = kv_reads(D_EARLY)["req-b"]["pages"]
    assert [p["generation"] for p in read] == [2]  # A's pages, handed out without a drain
    # ... but A's in-flight batch landed on B's page after B's checks: B decoded from A's KV.
    assert read[0]["at_finish"] != read[0]["at_accept"]
    assert metric(D_EARLY, "kvguard_engine_handoff_late_write_pages_total") >= 1
    assert "early_release_on_abort" in capacity(D_EARLY)["faults"]


def test_prefill_killed_mid_transfer_fails_the_request_and_drains_pages() -> None:
    events: list[Any] = []
    with _start_stream(D_ORPHANED, prompt_of(200, "k"), 8, "req-k") as response:
        lines = response.iter_lines()
        next(lines)
        wait_for(lambda: _transferring(P_DOOMED), 20, "prefill writing")
        P_DOOMED.kill()
        for line in lines:
            if line.startswith("data: "):
                data = line[len("data: ") :]
                events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]"
    error = events[-2]
    assert error["error"]["code"] == "prefill_unavailable"
    assert error["kvguard"]["handoff"]["outcome"] == "lost"
    pages = -(-200 // PAGE)  # the prompt's, reserved for the handoff
    assert capacity(D_ORPHANED)["quarantined_pages"] == pages  # a write may still be in flight
    assert metric(D_ORPHANED, "kvguard_engine_pool_pages", state="quarantined") == pages
    # No acknowledgement can come: the pages leave quarantine after lease + drain bound (3.5 s).
    wait_for(lambda: capacity(D_ORPHANED)["quarantined_pages"] == 0, 10, "drain deadline", 0.1)
    assert capacity(D_ORPHANED)["free_pages"] == 512 // PAGE
    assert metric(D_ORPHANED, "kvguard_engine_drained_pages_total", release="timeout") == pages
    assert metric(D_ORPHANED, "kvguard_engine_drain_seconds_count", release="timeout") == 1
    # Held at least the drain bound after the loss (its message-delay slack alone is 0.5 s).
    assert metric(D_ORPHANED, "kvguard_engine_drain_seconds_sum", release="timeout") >= 0.5
    # Fail closed afterwards: prefill is gone, so new requests are refused before reserving.
    refused = complete(D_ORPHANED, "x", max_tokens=2, request_id="req-after")
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "prefill_unavailable"


def test_decode_restarted_mid_transfer_prefill_leftovers_are_refused() -> None:
    handoffs = "kvguard_engine_handoffs_total"
    failed_before = metric(P_SLOW, handoffs, outcome="failed")
    with _start_stream(D_DOOMED, prompt_of(R_PROMPT, "r"), 8, "req-r") as response:
        lines = response.iter_lines()
        next(lines)
        wait_for(lambda: _transferring(P_SLOW), 20, "prefill writing")
        D_DOOMED.kill()
        del lines
    served_in_flight, deadline = 0, time.monotonic() + 20
    while metric(P_SLOW, handoffs, outcome="failed") == failed_before:
        assert time.monotonic() < deadline, "the old handoff never ended"
        # Back to back, reusing the request id, until the old write has landed or failed; in
        # turn, the successor's pool hands out the page ids the old handoff is writing to.
        served_in_flight += _transferring(P_SLOW)  # only the old handoff can be transferring
        fresh = complete(D_SUCCESSOR, prompt_of(20, "n"), max_tokens=64, request_id="req-r")
        assert fresh.status_code == 200, fresh.text
        proof = fresh.json()["kvguard"]["handoff"]
        assert proof["accepted"] is True and proof["transferred_tokens"] == 20
        # Nothing the old handoff sent reached these pages between the checks and the end.
        read = kv_reads(D_SUCCESSOR)["req-r"]["pages"]
        assert all(page["at_finish"] == page["at_accept"] for page in read)
    assert served_in_flight >= 1, "no request was served while the old write was in flight"
    # The old write went to a transfer endpoint that no longer exists: refused, so the old
    # handoff ended FAILED with its staging memory released.
    assert metric(P_SLOW, handoffs, outcome="failed") == failed_before + 1
    wait_for(
        lambda: (
            metric(P_SLOW, "kvguard_engine_staging_pages", state="free")
            == metric(P_SLOW, "kvguard_engine_staging_pages", state="total")
        ),
        5,
        "staging released",
    )
