"""An audit row's parameters and its spooled form, built field by field (``AuditRecord.params``)
rather than by ``dataclasses.asdict`` (a deep copy of every value, per row, on the flush that holds
the GIL): the same columns and values, nothing added, nothing lost."""

from __future__ import annotations

from dataclasses import asdict, fields
from datetime import UTC, datetime

from gateway.db.models import RequestAudit
from gateway.services.audit import AuditRecord
from tests.gateway.audit_rows import audit_record


def _record() -> AuditRecord:
    return audit_record(
        "r1",
        key_prefix="kvg_0123456789ab",
        stream=False,
        completion_tokens=3,
        handoff_outcome="ok",
        reserved_tokens=7,
        transferred_tokens=7,
        started_at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        ttft_ms=1.5,
        duration_ms=2.5,
    )


def test_the_insert_parameters_are_every_field_as_asdict_gives_it() -> None:
    record = _record()
    assert record.params() == asdict(record)
    assert set(record.params()) == {f.name for f in fields(AuditRecord)}
    assert set(record.params()) <= set(RequestAudit.__table__.c.keys())


def test_a_spooled_record_reads_back_equal() -> None:
    record = _record()
    spooled = record.to_spool()
    assert spooled["started_at"] == "2026-01-02T03:04:05+00:00"
    assert AuditRecord.from_spool(spooled) == record
