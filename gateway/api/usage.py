"""Usage summaries as the API shows them (a tenant's own, or any tenant's for the admin)."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy.orm import Session

from gateway.api.schemas_admin import OutcomeUsageOut, UsageOut
from gateway.services.tenants import usage


def usage_out(
    session: Session, *, tenant_id: str, since: datetime | None, until: datetime | None
) -> UsageOut:
    summary = usage(session, tenant_id=tenant_id, since=since, until=until)
    return UsageOut(
        tenant_id=summary.tenant_id,
        since=summary.since,
        until=summary.until,
        requests=summary.requests,
        prompt_tokens=summary.prompt_tokens,
        completion_tokens=summary.completion_tokens,
        by_outcome=[
            OutcomeUsageOut(
                outcome=row.outcome,
                requests=row.requests,
                prompt_tokens=row.prompt_tokens,
                completion_tokens=row.completion_tokens,
            )
            for row in summary.by_outcome
        ],
    )
