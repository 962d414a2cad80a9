"""``canary.corroboration``: suspected findings counted per engine, by requesting tenant, within a
sliding window; and the severity a replay gets."""

from __future__ import annotations

import pytest

from canary.corroboration import MAX_ENTRIES, Corroboration
from canary.kinds import Evidence, FindingKind, FindingSeverity, severity_of


def test_distinct_requesting_tenants_within_the_window_are_counted() -> None:
    c = Corroboration(window_s=600, tenants=2)
    assert c.add("e1", "a", now=0) == 1 and not c.reached(1)
    assert c.add("e1", "a", now=10) == 1  # the same tenant again: still one
    assert c.add("e2", "b", now=20) == 1  # another engine counts apart
    assert c.add("e1", "b", now=30) == 2 and c.reached(2)


def test_findings_older_than_the_window_no_longer_count() -> None:
    c = Corroboration(window_s=60, tenants=2)
    c.add("e1", "a", now=0)
    assert c.add("e1", "b", now=61) == 1  # a's finding left the window
    assert c.add("e1", "c", now=100) == 2


def test_forget_starts_an_engine_over_and_memory_is_bounded() -> None:
    c = Corroboration(window_s=10**9, tenants=2)
    c.add("e1", "a", now=0)
    c.forget("e1")
    assert c.add("e1", "b", now=1) == 1
    for n in range(MAX_ENTRIES + 10):
        c.add("e2", f"t{n}", now=n)
    assert c.add("e2", "last", now=MAX_ENTRIES + 20) == MAX_ENTRIES


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        Corroboration(window_s=0, tenants=2)


def test_a_replay_is_high_whatever_its_evidence() -> None:
    for evidence in (Evidence.CONFIRMED, Evidence.SUSPECTED):
        assert severity_of(evidence, FindingKind.REPLAY) is FindingSeverity.HIGH
    assert severity_of(Evidence.CONFIRMED, FindingKind.CROSS_TENANT) is FindingSeverity.CRITICAL
