"""An exhaustive, bounded model checker of the prefill -> decode handoff and the page lifecycle.

It drives the code's own pieces (``PagePool``, ``RequestState``/``TRANSITIONS``, the handoff
tables through ``Machine``, the ``FaultSet``, the message classes through their wire codec,
``admit``, ``verify_result``, ``refusal``, prefill's transfer-loop decisions) and models only what
lies outside them: page memory, decode's landing slots and what is registered with the transport,
in-flight one-sided writes, an unordered control channel, client aborts and timeouts, role
crashes, prefill's lease clock, a peer on another protocol version, and an adversary on the
transfer port that writes into whatever is registered at any moment (``adversary``).

Lifecycle of one run (``check``): build the initial ``World`` of a ``Bound`` -> breadth-first
over every enabled move (``actions.successors``), hashing states (``World.key``) -> judge the named
invariants on every new state (``invariants``) -> stop at the first violation with the shortest
trace, or finish and check liveness under fairness -> ``Report``.

    .venv/bin/python -m backend.verify [--bound small|large] [--fault NAME ...]

Mutation check: each fault drill, turned on in the model, yields a counterexample for the
property it breaks (asserted in ``tests/backend/verify``). ``MUTATIONS`` is this table; a bound
``<name>-open`` is that bound on the open channel (decode's pages registered, no seal: the sealed
channel's defences off):

======================================================  ==============  =========================
faults turned on                                        bound           invariant violated
======================================================  ==============  =========================
legacy_reject_handoff                                   incident        5 rejection
legacy_reject_handoff + skip_transfer_check             incident        1 evidence
  + skip_generation_check + skip_checksum
the four above + no_zero_on_free                        incident        2 owner reads
early_release_on_abort                                  reuse           3 no free under write
early_release_on_abort                                  reuse-open      4 no late read
(none: the open channel)                                adversary-open  12 no exposure
(none: the open channel)                                adversary-open  11 own transfer
skip_seal_check                                         adversary       11 own transfer
shared_prefix_across_tenants                            prefix          7 shared one salt
no_zero_on_free                                         preempt         8 preempted unread
======================================================  ==============  =========================

Every handoff row breaks on the open channel too (the new defences off, every old fault still
shows). On the sealed channel the early-release drill no longer reaches property 4: a late write
lands in a landing slot, and in a slot that a new handoff holds it only makes that handoff's seal
fail. The adversary (bound ``adversary``) breaks nothing on the sealed channel; on the open one it
reads live pages (12) and its write into an accepted request's page is served (11); with the seal
check skipped, its write into a landing slot is moved into the pages and served (11).

Each skip_* drill alone cannot break anything with an honest prefill (its check is one of those
that refuse the legacy placeholder), so each is shown the other way round: with the incident set
minus that one drill, property 1 holds again (that defence alone stops the incident).
No fault drill disables the version check, so nothing breaks property 6.

The engine model (``engine_world``, bounds ``prefix`` and ``preempt``) runs one unified engine's
own scheduler, KV manager, prefix cache and pool: shared and preempted pages, properties 7-10.
With the shared-prefix drill, two tenants' requests read one page (7): the counterexample is the
CVE-2025-46570 shape. Without zeroing, a page a preemption gave back is read again before anyone
zeroed it (8); its content is still the new reader's own (9 holds: a request writes a position
before it reads it), which is why 8 is stated on pages, not content. Nothing breaks 9 or 10: no
drill feeds a request another's K/V or changes what it computes.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.disagg.faults import Fault
from backend.verify.bounds import BOUNDS
from backend.verify.explore import LIVENESS, Report, check
from backend.verify.invariants import ALL_INVARIANTS, Invariant
from backend.verify.world import Bound, RequestSpec

INCIDENT_FAULTS = frozenset(
    {
        Fault.LEGACY_REJECT_HANDOFF,
        Fault.SKIP_TRANSFER_CHECK,
        Fault.SKIP_GENERATION_CHECK,
        Fault.SKIP_CHECKSUM,
    }
)


@dataclass(frozen=True, slots=True)
class Mutation:
    """Turning ``faults`` on in bound ``bound`` must yield a counterexample for ``breaks``."""

    faults: frozenset[Fault]
    bound: str
    breaks: Invariant


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(frozenset({Fault.LEGACY_REJECT_HANDOFF}), "incident", Invariant.REJECTION),
    Mutation(INCIDENT_FAULTS, "incident", Invariant.EVIDENCE),
    Mutation(INCIDENT_FAULTS | {Fault.NO_ZERO_ON_FREE}, "incident", Invariant.OWNER_READS),
    Mutation(frozenset({Fault.EARLY_RELEASE_ON_ABORT}), "reuse", Invariant.NO_FREE_UNDER_WRITE),
    Mutation(frozenset({Fault.EARLY_RELEASE_ON_ABORT}), "reuse-open", Invariant.NO_LATE_READ),
    Mutation(frozenset(), "adversary-open", Invariant.NO_EXPOSURE),
    Mutation(frozenset(), "adversary-open", Invariant.OWN_TRANSFER),
    Mutation(frozenset({Fault.SKIP_SEAL_CHECK}), "adversary", Invariant.OWN_TRANSFER),
    Mutation(frozenset({Fault.SHARED_PREFIX_ACROSS_TENANTS}), "prefix", Invariant.SHARED_ONE_SALT),
    Mutation(frozenset({Fault.NO_ZERO_ON_FREE}), "preempt", Invariant.PREEMPTED_UNREAD),
)

__all__ = [
    "ALL_INVARIANTS",
    "BOUNDS",
    "INCIDENT_FAULTS",
    "LIVENESS",
    "MUTATIONS",
    "Mutation",
    "Bound",
    "Invariant",
    "Report",
    "RequestSpec",
    "check",
]
