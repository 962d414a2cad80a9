"""The handoff state tables, decode's checks on positive evidence, the drain bound, fault sets."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import pytest
from disagg_messages import GRANTS, ok_result

from backend.core.errors import InvalidTransition
from backend.disagg.faults import Fault, FaultDrillRefused, FaultSet
from backend.disagg.machines import (
    ALL_CHECKS,
    DECODE_TERMINAL,
    DECODE_TRANSITIONS,
    DECODE_TRANSITIONS_EARLY_RELEASE,
    OUTCOME_OF,
    PREFILL_TERMINAL,
    PREFILL_TRANSITIONS,
    PREFILL_WRITING,
    Check,
    DecodeHandoffState,
    Expectation,
    PrefillHandoffState,
    drain_bound_s,
    release_deadline,
    verify_result,
)
from backend.disagg.protocol import ErrorInfo, HandoffOutcome, PageGrant, TokenRange
from contracts.lifecycle import Machine

D, P = DecodeHandoffState, PrefillHandoffState

EXPECTED_DECODE = {
    D.RESERVED: {D.AWAITING_RESULT, D.RELEASED},
    D.AWAITING_RESULT: {D.VERIFYING, D.DRAINING},
    D.VERIFYING: {D.ACCEPTED, D.RELEASED},
    D.ACCEPTED: set(),
    D.DRAINING: {D.RELEASED},
    D.RELEASED: set(),
}
EXPECTED_PREFILL = {
    P.RECEIVED: {P.COMPUTING, P.REJECTED, P.ABORTED, P.FAILED},
    P.COMPUTING: {P.TRANSFERRING, P.ABORTED, P.FAILED},
    P.TRANSFERRING: {P.SUCCEEDED, P.CANCELLING, P.FAILED},
    P.CANCELLING: {P.ABORTED, P.FAILED},
    P.SUCCEEDED: set(),
    P.REJECTED: set(),
    P.ABORTED: set(),
    P.FAILED: set(),
}


def test_tables_and_terminal_sets_are_exact() -> None:
    assert {k: set(v) for k, v in DECODE_TRANSITIONS.items()} == EXPECTED_DECODE
    assert {k: set(v) for k, v in PREFILL_TRANSITIONS.items()} == EXPECTED_PREFILL
    assert frozenset({D.ACCEPTED, D.RELEASED}) == DECODE_TERMINAL
    assert frozenset({P.SUCCEEDED, P.REJECTED, P.ABORTED, P.FAILED}) == PREFILL_TERMINAL
    assert set(OUTCOME_OF) == set(PREFILL_TERMINAL)
    assert frozenset({P.TRANSFERRING, P.CANCELLING}) == PREFILL_WRITING
    # Decode never frees pages straight from a state in which writes may land ...
    assert D.RELEASED not in DECODE_TRANSITIONS[D.AWAITING_RESULT]
    # ... except in the early-release drill, which differs by exactly that one edge.
    diff = {
        (src, dst)
        for src, dsts in DECODE_TRANSITIONS_EARLY_RELEASE.items()
        for dst in dsts
        if dst not in DECODE_TRANSITIONS[src]
    }
    assert diff == {(D.AWAITING_RESULT, D.RELEASED)}


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(P, P)))
def test_prefill_machine_allows_exactly_the_table(src: P, dst: P) -> None:
    machine = Machine("prefill handoff", "r", PREFILL_TRANSITIONS, src)
    if dst in EXPECTED_PREFILL[src]:
        machine.advance(dst)
        assert machine.state is dst
    else:
        with pytest.raises(InvalidTransition):
            machine.advance(dst)
        assert machine.state is src


EXPECT = Expectation("req-1", "inst-1", 20, GRANTS)


def run(
    result: Any,
    enforced: frozenset[Check] = ALL_CHECKS,
    current: bool = True,
    local: str = "sha256:abc",
    sealed: str | None = None,
) -> tuple[Any, list[str]]:
    calls: list[str] = []

    def pages_current(grants: Sequence[PageGrant]) -> bool:
        calls.append("pages")
        return current

    def unsealed() -> str | None:
        calls.append("seal")
        return sealed

    def checksum() -> str:
        calls.append("checksum")
        return local

    verdict = verify_result(
        EXPECT,
        result,
        enforced=enforced,
        pages_current=pages_current,
        unsealed=unsealed,
        local_checksum=checksum,
    )
    return verdict, calls


def test_an_ok_result_without_the_first_tokens_asked_logprobs_is_refused() -> None:
    asked = Expectation("req-1", "inst-1", 20, GRANTS, logprobs=True)

    def verdict_for(result: Any) -> Any:
        return verify_result(
            asked,
            result,
            enforced=ALL_CHECKS,
            pages_current=lambda grants: True,
            unsealed=lambda: None,
            local_checksum=lambda: "sha256:abc",
        )

    assert verdict_for(ok_result()).accepted
    refused = verdict_for(ok_result(first_token_logprobs=None))
    assert not refused.accepted and refused.failed is Check.OUTCOME
    assert "no logprobs for the first token" in refused.detail
    assert run(ok_result(first_token_logprobs=None))[0].accepted  # not asked: not needed


def test_positive_evidence_is_accepted_after_every_check() -> None:
    verdict, calls = run(ok_result())
    assert verdict.accepted and verdict.failed is None
    assert verdict.ran == tuple(Check) and verdict.skipped == ()
    assert calls == ["pages", "seal", "checksum"]


@pytest.mark.parametrize(
    ("changes", "failed"),
    [
        ({"request_id": "req-2"}, Check.IDENTITY),
        ({"instance_id": "old-decode"}, Check.IDENTITY),
        (
            {
                "outcome": HandoffOutcome.REJECTED,
                "error": ErrorInfo("context_length_exceeded", 400, "too long"),
                "transferred": None,
                "checksum": None,
                "first_token": None,
                "pages_written": (),
            },
            Check.OUTCOME,
        ),
        ({"transferred": TokenRange(0, 1)}, Check.TRANSFER_RANGE),  # the incident's "done"
        ({"pages_written": GRANTS[:1]}, Check.PAGE_GENERATIONS),
        ({"pages_written": (GRANTS[0], PageGrant(7, 3))}, Check.PAGE_GENERATIONS),
        ({"checksum": "sha256:other"}, Check.CHECKSUM),
    ],
)
def test_each_missing_piece_of_evidence_refuses(changes: dict[str, Any], failed: Check) -> None:
    verdict, _ = run(ok_result(**changes))
    assert not verdict.accepted and verdict.failed is failed


def test_stale_pages_refuse_even_when_the_result_names_them() -> None:
    verdict, calls = run(ok_result(), current=False)
    assert verdict.failed is Check.PAGE_GENERATIONS
    assert "checksum" not in calls  # no KV is hashed for a request whose pages are not its own


def test_skipped_checks_are_reported_and_mismatches_still_observed() -> None:
    legacy = ok_result(
        transferred=TokenRange(0, 1), pages_written=GRANTS[:1], checksum="sha256:placeholder"
    )
    enforced = ALL_CHECKS - {Check.TRANSFER_RANGE, Check.PAGE_GENERATIONS, Check.CHECKSUM}
    verdict, calls = run(legacy, enforced)
    assert verdict.accepted  # the drill: nothing left that could refuse it
    assert set(verdict.skipped) == {Check.TRANSFER_RANGE, Check.PAGE_GENERATIONS, Check.CHECKSUM}
    assert verdict.transfer_mismatch is True and verdict.checksum_mismatch is None
    assert calls == ["seal"]  # the one page written is still opened under its seal


def test_a_page_that_does_not_open_refuses_before_the_checksum() -> None:
    verdict, calls = run(ok_result(), sealed="page 1 of the prompt is not sealed for this handoff")
    assert not verdict.accepted and verdict.failed is Check.SEAL
    assert verdict.detail.startswith("page 1") and calls == ["pages", "seal"]
    # The open channel (or the skip_seal_check drill) runs without it.
    verdict, calls = run(ok_result(), ALL_CHECKS - {Check.SEAL}, sealed="never asked")
    assert verdict.accepted and verdict.skipped == (Check.SEAL,) and "seal" not in calls


def test_drain_bound_and_release_deadline() -> None:
    # 8 pages x 2 layers x (K, V) x 2 KiB at 1 MB/s, plus 0.5 s for one message.
    batch = 8 * 2 * 2 * 2048
    assert drain_bound_s(batch, 1e6, 0.5) == pytest.approx(batch / 1e6 + 0.5)
    with pytest.raises(ValueError):
        drain_bound_s(batch, 0, 0.5)
    # A lost peer may start batches until its lease ends, then one batch may still land.
    assert release_deadline(now=10.0, sent_at=5.0, lease_s=30.0, drain_s=1.0) == 36.0
    assert release_deadline(now=50.0, sent_at=5.0, lease_s=30.0, drain_s=1.0) == 51.0


def test_fault_sets_are_refused_unless_allowed_and_applicable() -> None:
    assert FaultSet.parse([], role="decode", allowed=False) == FaultSet()
    with pytest.raises(FaultDrillRefused, match="need --allow-fault-drills"):
        FaultSet.parse(["skip_checksum"], role="decode", allowed=False)
    with pytest.raises(FaultDrillRefused, match="applies to decode, not to prefill"):
        FaultSet.parse(["skip_checksum"], role="prefill", allowed=True)
    with pytest.raises(FaultDrillRefused, match="unknown fault 'skip_everything'"):
        FaultSet.parse(["skip_everything"], role="decode", allowed=True)
    with pytest.raises(FaultDrillRefused, match="not to unified"):
        FaultSet.parse(["legacy_reject_handoff"], role="unified", allowed=True)


def test_each_fault_removes_exactly_its_defence() -> None:
    clean = FaultSet()
    assert clean.enforced_checks == ALL_CHECKS and clean.cross_role_admission
    assert clean.decode_table is DECODE_TRANSITIONS and clean.zero_on_free(True)
    removed = {
        Fault.SKIP_TRANSFER_CHECK: Check.TRANSFER_RANGE,
        Fault.SKIP_GENERATION_CHECK: Check.PAGE_GENERATIONS,
        Fault.SKIP_CHECKSUM: Check.CHECKSUM,
        Fault.SKIP_SEAL_CHECK: Check.SEAL,
    }
    for fault, check in removed.items():
        assert FaultSet(frozenset({fault})).enforced_checks == ALL_CHECKS - {check}
    legacy = FaultSet(frozenset({Fault.LEGACY_REJECT_HANDOFF}))
    assert not legacy.cross_role_admission and legacy.placeholder_on_reject
    assert legacy.enforced_checks == ALL_CHECKS
    early = FaultSet(frozenset({Fault.EARLY_RELEASE_ON_ABORT}))
    assert early.decode_table is DECODE_TRANSITIONS_EARLY_RELEASE and early.early_release
    assert not FaultSet(frozenset({Fault.NO_ZERO_ON_FREE})).zero_on_free(True)
