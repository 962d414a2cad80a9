"""An audit row for the tests that write them: a completed chat completion's, every field set."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from gateway.services.audit import AuditRecord


def audit_record(request_id: str, **changes: Any) -> AuditRecord:
    record = AuditRecord(
        request_id=request_id,
        tenant_id="tn_1",
        key_prefix=None,
        endpoint="chat",
        model="m",
        engine="e",
        stream=True,
        prompt_tokens=10,
        max_tokens=4,
        completion_tokens=4,
        outcome="completed",
        http_status=200,
        error_code=None,
        handoff_outcome=None,
        reserved_tokens=None,
        transferred_tokens=None,
        started_at=datetime.now(UTC),
        ttft_ms=1.0,
        duration_ms=2.0,
    )
    return replace(record, **changes) if changes else record
