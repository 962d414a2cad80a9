"""The handoff's state machines as transition tables, the decode-side checks, and the drain bound.

Both sides of one handoff are explicit lifecycles (one enum, one table, one TERMINAL set each); a
move that is not in the table raises ``InvalidTransition``. The model checker explores exactly these
tables and ``verify_result``; fault drills that change behaviour swap in a named table variant
(``DECODE_TRANSITIONS_EARLY_RELEASE``) or drop named checks, so the checker can show what each one
breaks.

Decode, per request (``DECODE_TRANSITIONS``)::

    RESERVED ──request sent──▶ AWAITING_RESULT ──result──▶ VERIFYING ──all checks pass──▶ ACCEPTED
       │                          │                           └──a check fails──▶ RELEASED
       └──aborted before sending──┼──────────────────────────────────────────────▶ RELEASED
                                  └──abort | timeout | peer lost | bad reply──▶ DRAINING
    DRAINING ──AbortAck(quiesced) | late result | drain deadline──▶ RELEASED

    A result is sent only once prefill is quiescent, so a refused one frees the pages at once.
    Pages are QUARANTINED in the pool for the whole of DRAINING (unreadable, unallocatable);
    leaving it bumps their generations. With the ``early_release_on_abort`` drill the table also
    has AWAITING_RESULT -> RELEASED: pages go back to the free list while a write may still land.

Prefill, per request (``PREFILL_TRANSITIONS``)::

    RECEIVED ──own admission──▶ COMPUTING ──KV staged──▶ TRANSFERRING ──last batch──▶ SUCCEEDED
       └──refused──▶ REJECTED      └──▶ ABORTED | FAILED     ├──error, lease over──▶ FAILED
                                                              └──abort──▶ CANCELLING
    CANCELLING ──batch in flight returned──▶ ABORTED | FAILED

    Writes can be in flight only in TRANSFERRING and CANCELLING (``PREFILL_WRITING``). The result
    is sent, and an abort acknowledged as quiesced, only from a terminal state. Prefill starts no
    batch after its lease, and never has more than ``max_batch_pages`` pages in flight.

The drain bound (``drain_bound_s``): after an abort, at most one batch of at most
``max_batch_pages`` pages is in flight (prefill checks for cancellation before each batch). At a
transfer bandwidth floor of ``min_bytes_per_s`` that batch lands within
``batch_bytes / min_bytes_per_s``; the slack covers one control-message delay. If prefill cannot
be reached at all, it may still start batches until its lease ends, so a lost peer's pages drain
until ``max(now, sent_at + lease) + drain_bound`` (``release_deadline``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from backend.core.errors import KvguardError
from backend.core.request import RequestState
from backend.disagg.errors import HandoffFailed, HandoffRefused, RemoteEngineError
from backend.disagg.protocol import HandoffOutcome, PageGrant, PrefillResult, TokenRange


class DecodeHandoffState(StrEnum):
    RESERVED = "reserved"
    AWAITING_RESULT = "awaiting_result"
    VERIFYING = "verifying"
    ACCEPTED = "accepted"
    DRAINING = "draining"
    RELEASED = "released"


_D = DecodeHandoffState

DECODE_TRANSITIONS: Mapping[DecodeHandoffState, frozenset[DecodeHandoffState]] = MappingProxyType(
    {
        _D.RESERVED: frozenset({_D.AWAITING_RESULT, _D.RELEASED}),
        _D.AWAITING_RESULT: frozenset({_D.VERIFYING, _D.DRAINING}),
        _D.VERIFYING: frozenset({_D.ACCEPTED, _D.RELEASED}),
        _D.ACCEPTED: frozenset(),
        _D.DRAINING: frozenset({_D.RELEASED}),
        _D.RELEASED: frozenset(),
    }
)

# The early_release_on_abort drill: an abort frees pages while a remote write may still land.
DECODE_TRANSITIONS_EARLY_RELEASE: Mapping[DecodeHandoffState, frozenset[DecodeHandoffState]] = (
    MappingProxyType(
        {
            **DECODE_TRANSITIONS,
            _D.AWAITING_RESULT: DECODE_TRANSITIONS[_D.AWAITING_RESULT] | {_D.RELEASED},
        }
    )
)

DECODE_TERMINAL = frozenset({_D.ACCEPTED, _D.RELEASED})
# States in which prefill may write into the reserved pages.
DECODE_WRITABLE = frozenset({_D.AWAITING_RESULT, _D.DRAINING})


class PrefillHandoffState(StrEnum):
    RECEIVED = "received"
    COMPUTING = "computing"
    TRANSFERRING = "transferring"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    REJECTED = "rejected"
    ABORTED = "aborted"
    FAILED = "failed"


_P = PrefillHandoffState

PREFILL_TRANSITIONS: Mapping[PrefillHandoffState, frozenset[PrefillHandoffState]] = (
    MappingProxyType(
        {
            _P.RECEIVED: frozenset({_P.COMPUTING, _P.REJECTED, _P.ABORTED, _P.FAILED}),
            _P.COMPUTING: frozenset({_P.TRANSFERRING, _P.ABORTED, _P.FAILED}),
            _P.TRANSFERRING: frozenset({_P.SUCCEEDED, _P.CANCELLING, _P.FAILED}),
            _P.CANCELLING: frozenset({_P.ABORTED, _P.FAILED}),
            _P.SUCCEEDED: frozenset(),
            _P.REJECTED: frozenset(),
            _P.ABORTED: frozenset(),
            _P.FAILED: frozenset(),
        }
    )
)

PREFILL_TERMINAL = frozenset({_P.SUCCEEDED, _P.REJECTED, _P.ABORTED, _P.FAILED})
PREFILL_WRITING = frozenset({_P.TRANSFERRING, _P.CANCELLING})
OUTCOME_OF: Mapping[PrefillHandoffState, HandoffOutcome] = MappingProxyType(
    {
        _P.SUCCEEDED: HandoffOutcome.OK,
        _P.REJECTED: HandoffOutcome.REJECTED,
        _P.ABORTED: HandoffOutcome.ABORTED,
        _P.FAILED: HandoffOutcome.FAILED,
    }
)

# -- decode's verification: positive evidence only ------------------------------------------------


class Check(StrEnum):
    """Decode's checks on a PrefillResult, in the order they run."""

    IDENTITY = "identity"  # request id and decode instance are ours
    OUTCOME = "outcome"  # prefill says OK (with the first token's logprobs, if asked)
    TRANSFER_RANGE = "transfer_range"  # transferred == [0, reserved)
    PAGE_GENERATIONS = "page_generations"  # written pages == reserved, still current and ours
    SEAL = "seal"  # every written page's chunk opens under this handoff's key, for its position
    CHECKSUM = "checksum"  # digest of the KV we would serve == prefill's digest of what it sent


ALL_CHECKS = frozenset(Check)
# Checks a fault drill may switch off; identity and outcome are never optional.
SKIPPABLE_CHECKS = frozenset(
    {Check.TRANSFER_RANGE, Check.PAGE_GENERATIONS, Check.SEAL, Check.CHECKSUM}
)


@dataclass(frozen=True, slots=True)
class Expectation:
    """What decode reserved and therefore what a result must prove."""

    request_id: str
    instance_id: str
    reserved_tokens: int
    grants: tuple[PageGrant, ...]  # the prompt's pages, in order
    logprobs: bool = False  # the request asked for logprobs: the first token's must come back


@dataclass(frozen=True, slots=True)
class Verdict:
    accepted: bool
    failed: Check | None
    detail: str
    ran: tuple[Check, ...]
    skipped: tuple[Check, ...]
    transfer_mismatch: bool  # observed even when the check is switched off
    checksum_mismatch: bool | None  # None: not computed


def verify_result(
    expect: Expectation,
    result: PrefillResult,
    *,
    enforced: frozenset[Check],
    pages_current: Callable[[Sequence[PageGrant]], bool],
    unsealed: Callable[[], str | None],
    local_checksum: Callable[[], str],
) -> Verdict:
    """Run decode's checks in order; accept only if every enforced check found its evidence.

    ``unsealed`` opens the written pages' chunks from decode's private copy and says what failed
    (None: every one is this handoff's, for its position); ``local_checksum`` digests the KV
    decode would move into its pages. The open channel has no seal: it runs without SEAL.
    """
    ran: list[Check] = []
    failure: tuple[Check, str] | None = None
    expected_range = TokenRange(0, expect.reserved_tokens)
    mismatch = result.transferred != expected_range
    findings: list[tuple[Check, Callable[[], str | None]]] = [
        (Check.IDENTITY, lambda: _identity(expect, result)),
        (Check.OUTCOME, lambda: _outcome(expect, result)),
        (Check.TRANSFER_RANGE, lambda: _range_problem(result.transferred, expected_range)),
        (Check.PAGE_GENERATIONS, lambda: _pages_problem(expect, result, pages_current)),
        (Check.SEAL, unsealed),
    ]
    checksum_mismatch: bool | None = None
    for check, find in findings:
        if check not in enforced and check in SKIPPABLE_CHECKS:
            continue
        ran.append(check)
        problem = find()
        if problem is not None:
            failure = (check, problem)
            break
    if failure is None and Check.CHECKSUM in enforced:
        ran.append(Check.CHECKSUM)
        checksum_mismatch = result.checksum != local_checksum()
        if checksum_mismatch:
            failure = (Check.CHECKSUM, "digest of the reserved KV differs from prefill's digest")
    skipped = tuple(c for c in Check if c not in ran and c in SKIPPABLE_CHECKS - enforced)
    return Verdict(
        failure is None,
        failure[0] if failure else None,
        failure[1] if failure else "",
        tuple(ran),
        skipped,
        mismatch,
        checksum_mismatch,
    )


def _identity(expect: Expectation, result: PrefillResult) -> str | None:
    if result.request_id != expect.request_id or result.instance_id != expect.instance_id:
        return "the result names another request or decode instance"
    return None


def _outcome(expect: Expectation, result: PrefillResult) -> str | None:
    if result.outcome is not HandoffOutcome.OK:
        return f"prefill reported {result.outcome.value}"
    if expect.logprobs and result.first_token_logprobs is None:
        return "prefill sent no logprobs for the first token, which the request asked for"
    return None


def _range_problem(got: TokenRange | None, want: TokenRange) -> str | None:
    if got != want:
        shown = f"[{got.start}, {got.end})" if got else "nothing"
        return f"reserved tokens [0, {want.end}), transferred {shown}"
    return None


def _pages_problem(
    expect: Expectation,
    result: PrefillResult,
    pages_current: Callable[[Sequence[PageGrant]], bool],
) -> str | None:
    if result.pages_written != expect.grants:
        return (
            f"{len(expect.grants)} pages reserved, prefill reports {len(result.pages_written)} "
            "written (or other pages/generations)"
        )
    if not pages_current(expect.grants):
        return "a reserved page is no longer current or no longer ours"
    return None


def refusal(
    request_id: str, result: PrefillResult, verdict: Verdict
) -> tuple[RequestState, KvguardError | None]:
    """How a refused result ends the request: prefill's own outcome with its original error.

    Shared by ``DecodeEngineCore`` and the model checker (``backend.verify``), so property 5
    (a rejection ends REJECTED with the original error) is checked on the code that runs.
    """
    if verdict.failed is Check.OUTCOME:
        error = result.error
        if result.outcome is HandoffOutcome.REJECTED and error is not None:
            return RequestState.REJECTED, RemoteEngineError(
                error.code, error.http_status, error.message
            )
        if result.outcome is HandoffOutcome.ABORTED:
            return RequestState.ABORTED, None
        reason = error.message if error is not None else f"prefill said {result.outcome}"
        return RequestState.FAILED, HandoffFailed(request_id, reason)
    check = verdict.failed.value if verdict.failed is not None else "unknown"
    return RequestState.FAILED, HandoffRefused(request_id, check, verdict.detail)


# -- prefill's transfer loop, as decisions --------------------------------------------------------


def may_start_batch(*, cancelled: bool, lease_over: bool) -> bool:
    """Prefill checks before every batch: once cancelled or past its lease, no batch starts."""
    return not cancelled and not lease_over


def lease_cut_short(*, written: int, total: int, cancelled: bool) -> bool:
    """The loop stopped before the last batch without a cancellation: the lease ended."""
    return written < total and not cancelled


def transfer_end(
    state: PrefillHandoffState, *, written: int, total: int, failed: bool
) -> PrefillHandoffState:
    """Prefill's terminal state once no batch is in flight (shared with ``backend.verify``).

    ``failed``: the transport raised, or the lease cut the transfer short. Only a transfer that
    wrote every page, uncancelled, SUCCEEDED; a cancelled or partial one is ABORTED.
    """
    if failed:
        return _P.FAILED
    if state is _P.CANCELLING or written < total:
        return _P.ABORTED
    return _P.SUCCEEDED


# -- the drain bound ------------------------------------------------------------------------------


def drain_bound_s(batch_bytes: int, min_bytes_per_s: float, slack_s: float) -> float:
    """Longest time one in-flight transfer batch can take to land, plus one message delay."""
    if batch_bytes < 1 or min_bytes_per_s <= 0 or slack_s < 0:
        raise ValueError("batch_bytes, min_bytes_per_s must be positive and slack_s >= 0")
    return batch_bytes / min_bytes_per_s + slack_s


def release_deadline(now: float, sent_at: float | None, lease_s: float, drain_s: float) -> float:
    """When quarantined pages may be freed without an acknowledgement from prefill."""
    lease_end = now if sent_at is None else max(now, sent_at + lease_s)
    return lease_end + drain_s
