"""Named fault drills: each one removes exactly one defence, chosen by configuration at start-up.

Off by default. A fault is accepted only with ``allow_fault_drills`` and only by a role it applies
to (a drill that silently does nothing would prove nothing); the server logs every enabled fault
at ERROR, exports ``kvguard_engine_fault_drill_enabled{fault}`` and lists it in
``/engine/capacity`` ``faults``. Nothing here reads the environment: ``FaultSet.parse`` gets the
names from the settings object built in ``main()``.

What each fault changes, and the safety property (issue 10 numbering) it is meant to break:

- ``legacy_reject_handoff`` (decode and prefill; each applies its side). Decode admits against its
  own pool only (no cross-role minimum). Prefill turns a refused prompt into a 1-token
  placeholder (sampled as the request asks, its grammar included), writes one page and replies OK
  ("done"), as in the incident. Together with the
  skip_* drills it breaks properties 1 and 5.
- ``skip_transfer_check`` (decode): no reserved == transferred token check. Breaks 1.
- ``skip_generation_check`` (decode): no pages-and-generations check. Breaks 1 and 2.
- ``skip_checksum`` (decode): no KV checksum check. Breaks 1.
- ``skip_seal_check`` (decode): the pages' seals are not checked: each written page's chunk is
  decrypted without its tag (what an unauthenticated cipher accepts), so bytes a peer of the
  transfer port wrote into a landing slot reach the pages. Breaks 11 (with the model's adversary).
- ``early_release_on_abort`` (decode): no quarantine on abort, pages are freed at once
  (``DECODE_TRANSITIONS_EARLY_RELEASE``). Breaks 3 and 4.
- ``no_zero_on_free`` (every role): released pages are not zeroed, so stale KV stays in memory.
- ``shared_prefix_across_tenants`` (unified and prefill): the prefix cache puts every tenant in
  one namespace (no per-tenant salt, the CVE-2025-46570 shape): a tenant's request reads pages
  another tenant's request computed, and its time to first token tells it so. Breaks the model
  checker's "a page readable by two requests belongs to one tenant's salt".

The incident's misconfiguration (a window larger than the prefill pool) is not a fault: it is
``allow_capacity_drift``, reported as ``drift``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType

from backend.disagg.machines import (
    ALL_CHECKS,
    DECODE_TRANSITIONS,
    DECODE_TRANSITIONS_EARLY_RELEASE,
    Check,
    DecodeHandoffState,
)


class Fault(StrEnum):
    LEGACY_REJECT_HANDOFF = "legacy_reject_handoff"
    SKIP_TRANSFER_CHECK = "skip_transfer_check"
    SKIP_GENERATION_CHECK = "skip_generation_check"
    SKIP_CHECKSUM = "skip_checksum"
    SKIP_SEAL_CHECK = "skip_seal_check"
    EARLY_RELEASE_ON_ABORT = "early_release_on_abort"
    NO_ZERO_ON_FREE = "no_zero_on_free"
    SHARED_PREFIX_ACROSS_TENANTS = "shared_prefix_across_tenants"


_ALL_ROLES = frozenset({"unified", "prefill", "decode"})
FAULT_ROLES: Mapping[Fault, frozenset[str]] = MappingProxyType(
    {
        Fault.LEGACY_REJECT_HANDOFF: frozenset({"prefill", "decode"}),
        Fault.SKIP_TRANSFER_CHECK: frozenset({"decode"}),
        Fault.SKIP_GENERATION_CHECK: frozenset({"decode"}),
        Fault.SKIP_CHECKSUM: frozenset({"decode"}),
        Fault.SKIP_SEAL_CHECK: frozenset({"decode"}),
        Fault.EARLY_RELEASE_ON_ABORT: frozenset({"decode"}),
        Fault.NO_ZERO_ON_FREE: _ALL_ROLES,
        Fault.SHARED_PREFIX_ACROSS_TENANTS: frozenset({"unified", "prefill"}),
    }
)

_CHECK_REMOVED: Mapping[Fault, Check] = MappingProxyType(
    {
        Fault.SKIP_TRANSFER_CHECK: Check.TRANSFER_RANGE,
        Fault.SKIP_GENERATION_CHECK: Check.PAGE_GENERATIONS,
        Fault.SKIP_CHECKSUM: Check.CHECKSUM,
        Fault.SKIP_SEAL_CHECK: Check.SEAL,
    }
)


class FaultDrillRefused(ValueError):
    """A fault was named without ``allow_fault_drills``, or for a role it does not apply to."""


@dataclass(frozen=True, slots=True)
class FaultSet:
    """The drills enabled in one process, and the behaviour they select."""

    faults: frozenset[Fault] = frozenset()

    @classmethod
    def parse(cls, names: Iterable[str], *, role: str, allowed: bool) -> FaultSet:
        faults: set[Fault] = set()
        for name in names:
            if name not in Fault._value2member_map_:
                known = ", ".join(f.value for f in Fault)
                raise FaultDrillRefused(f"unknown fault {name!r} (known: {known})")
            fault = Fault(name)
            if role not in FAULT_ROLES[fault]:
                roles = ", ".join(sorted(FAULT_ROLES[fault]))
                raise FaultDrillRefused(f"fault {name!r} applies to {roles}, not to {role}")
            faults.add(fault)
        if faults and not allowed:
            raise FaultDrillRefused(
                f"fault drills {sorted(f.value for f in faults)} need --allow-fault-drills"
            )
        return cls(frozenset(faults))

    def __contains__(self, fault: object) -> bool:
        return fault in self.faults

    @property
    def names(self) -> list[str]:
        return sorted(f.value for f in self.faults)

    @property
    def enforced_checks(self) -> frozenset[Check]:
        removed = {check for fault, check in _CHECK_REMOVED.items() if fault in self.faults}
        return ALL_CHECKS - removed

    @property
    def cross_role_admission(self) -> bool:
        """Decode admits against min(own pool, prefill's pool) unless the legacy drill is on."""
        return Fault.LEGACY_REJECT_HANDOFF not in self.faults

    @property
    def placeholder_on_reject(self) -> bool:
        """Prefill's legacy behaviour: swap a refused prompt for a placeholder and say OK."""
        return Fault.LEGACY_REJECT_HANDOFF in self.faults

    @property
    def decode_table(self) -> Mapping[DecodeHandoffState, frozenset[DecodeHandoffState]]:
        if Fault.EARLY_RELEASE_ON_ABORT in self.faults:
            return DECODE_TRANSITIONS_EARLY_RELEASE
        return DECODE_TRANSITIONS

    @property
    def early_release(self) -> bool:
        return Fault.EARLY_RELEASE_ON_ABORT in self.faults

    @property
    def per_tenant_cache_scopes(self) -> bool:
        """The prefix cache's namespaces are per tenant unless the shared-prefix drill is on."""
        return Fault.SHARED_PREFIX_ACROSS_TENANTS not in self.faults

    def zero_on_free(self, configured: bool) -> bool:
        return configured and Fault.NO_ZERO_ON_FREE not in self.faults
