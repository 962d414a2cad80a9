"""Decode's checks on one PrefillResult, and what they leave: the verdict, the opened KV (sealed
channel), the log lines and metrics of a refusal, the move into the pages, the proof.

The checks run in ``machines.verify_result``'s order: identity, outcome, transfer range, page
generations, the seal (``channel.unseal``: the landing slots withdrawn, copied once, every written
chunk opened from the copy), the checksum (over the opened KV; on the open channel over the pages
themselves). Nothing reaches the pages here but through ``move``, called for an accepted result
only. A refusal is logged by request id and counted (``kvguard_engine_handoff_refusals_total``
by check); it ends that request alone.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from backend.core.pages import Owner, PagePool, PageRef
from backend.disagg.channel import Landing, Opening, Unsealed, unseal
from backend.disagg.faults import FaultSet
from backend.disagg.kvio import algorithm_of, kv_digest
from backend.disagg.machines import Check, Expectation, Verdict, verify_result
from backend.disagg.protocol import PageGrant, PrefillResult
from backend.disagg.seal import Binding, Seal
from backend.metrics import EngineMetrics
from backend.model.kv_cache import KVCache
from contracts.engine import HandoffProof

log = logging.getLogger("kvguard.disagg.decode")


@dataclass(frozen=True, slots=True)
class HandoffFacts:
    """What one handoff brings to its checks."""

    request_id: str  # the client's (logs); expect.request_id is the handoff's on the wire
    expect: Expectation
    owner: Owner | None  # None: the request no longer awaits, its pages are not its own
    landing: Landing | None  # the sealed channel's slots (None: the open channel)
    seal: Seal | None = field(default=None, repr=False)


class ResultChecks:
    def __init__(
        self,
        *,
        pool: PagePool,
        kv: KVCache,
        faults: FaultSet,
        protocol_version: int,
        instance_id: str,
        metrics: EngineMetrics | None,
    ) -> None:
        self._pool, self._kv, self._faults = pool, kv, faults
        self._version, self._instance = protocol_version, instance_id
        self._metrics = metrics

    def check(self, facts: HandoffFacts, result: PrefillResult) -> tuple[Verdict, Unsealed | None]:
        """The verdict on ``result``; on the sealed channel also the opened pages to move."""
        expect, owner = facts.expect, facts.owner
        enforced = self._faults.enforced_checks
        if facts.landing is None:  # the open channel has no seal to check
            enforced = enforced - {Check.SEAL}
        opened: list[Unsealed] = []

        def pages_current(grants: Sequence[PageGrant]) -> bool:
            return owner is not None and all(
                self._pool.is_current(PageRef(g.page_id, g.generation), owner) for g in grants
            )

        def opening() -> Unsealed:
            if not opened:
                opened.append(self._unseal(facts, result, Check.SEAL in enforced))
            return opened[0]

        def local_checksum() -> str:
            algorithm = algorithm_of(result.checksum or "")
            if algorithm is None:  # an algorithm this node cannot recompute proves nothing
                return "unsupported checksum algorithm"
            started = time.perf_counter()
            n, ids = expect.reserved_tokens, [g.page_id for g in expect.grants]
            if facts.landing is None:
                digest = kv_digest(self._kv.k, self._kv.v, ids, n, algorithm)
            else:
                pages = opening()
                digest = kv_digest(pages.k, pages.v, range(len(ids)), n, algorithm)
            if self._metrics is not None:
                self._metrics.checksum_seconds.observe(time.perf_counter() - started)
            return digest

        verdict = verify_result(
            expect,
            result,
            enforced=enforced,
            pages_current=pages_current,
            unsealed=lambda: opening().problem,
            local_checksum=local_checksum,
        )
        self._observe(verdict, facts)
        return verdict, (opened[0] if opened else None)

    def move(self, facts: HandoffFacts, opened: Unsealed) -> None:
        """Every check passed: the opened pages go into the pool's pages."""
        started = time.perf_counter()
        opened.move_into(self._kv, [g.page_id for g in facts.expect.grants])
        self.phase("move", started)

    def phase(self, phase: str, started: float) -> None:
        """The sealed channel's work of one phase (``kvguard_engine_kv_channel_seconds``)."""
        if self._metrics is not None:
            self._metrics.kv_channel_seconds.labels(phase).observe(time.perf_counter() - started)

    def proof(self, facts: HandoffFacts, result: PrefillResult, verdict: Verdict) -> HandoffProof:
        transferred = result.transferred.num_tokens if result.transferred is not None else None
        return HandoffProof(
            self._version,
            result.outcome.value,
            facts.expect.reserved_tokens,
            transferred,
            verdict.accepted,
            tuple(c.value for c in verdict.ran),
            tuple(c.value for c in verdict.skipped),
            verdict.failed.value if verdict.failed is not None else None,
            round(result.transfer_s * 1000, 3),
            round(result.checksum_s * 1000, 3),
        )

    def _unseal(self, facts: HandoffFacts, result: PrefillResult, authenticate: bool) -> Unsealed:
        """Open the chunks of the pages prefill reports written (the granted pages it names, from
        the first on), from a private copy of the slots. The binding names the tokens prefill
        says it transferred (the range check is what holds that to the reservation)."""
        assert facts.landing is not None and facts.seal is not None
        expect = facts.expect
        reported, written = result.pages_written, 0
        while written < min(len(reported), len(expect.grants)):
            if reported[written] != expect.grants[written]:
                break
            written += 1
        n_tokens = result.transferred.end if result.transferred else expect.reserved_tokens
        binding = Binding(self._version, self._instance, expect.request_id, n_tokens)
        opening = Opening(facts.seal, binding, expect.grants, written, authenticate)
        opened = unseal(facts.landing, opening, self._kv)
        if self._metrics is not None:
            self._metrics.kv_channel_seconds.labels("copy").observe(opened.copy_s)
            self._metrics.kv_channel_seconds.labels("unseal").observe(opened.open_s)
        return opened

    def _observe(self, verdict: Verdict, facts: HandoffFacts) -> None:
        rid = facts.request_id
        refused = verdict.failed is not None and verdict.failed is not Check.OUTCOME
        if verdict.transfer_mismatch:
            reserved = facts.expect.reserved_tokens
            log.error("handoff %s: transferred range != reserved %d tokens", rid, reserved)
        if refused:
            log.error("handoff %s refused by the %s check: %s", rid, verdict.failed, verdict.detail)
        elif verdict.accepted and verdict.skipped:
            skipped = ", ".join(verdict.skipped)
            log.error("handoff %s ACCEPTED WITHOUT %s (fault drill)", rid, skipped)
        m = self._metrics
        if m is None:
            return
        if verdict.transfer_mismatch:
            m.handoff_transfer_mismatch.inc()
        if verdict.checksum_mismatch:
            m.handoff_checksum_failures.inc()
        if refused and verdict.failed is not None:
            m.handoff_refusals.labels(verdict.failed.value).inc()
