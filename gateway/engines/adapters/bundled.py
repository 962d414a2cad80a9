"""kvguard's bundled backend: ``GET /engine/capacity`` (``contracts.engine.CapacityReport``).

The report already carries every role on the serving path (decode reports prefill too), the
enabled fault drills, the engine's own drift statement and the request features it serves (tools,
structured output: ``gateway.openai.surface`` forwards those fields only where reported). A report
with another schema version is refused: the contract changed and this adapter must be updated
with it.
"""

from __future__ import annotations

from typing import Any

import httpx
from pydantic import ValidationError

from contracts.engine import CAPACITY_SCHEMA_VERSION, CapacityReport, RoleCapacity
from gateway.engines import prompt
from gateway.engines.adapters.base import AdapterError, EngineAdapter, get_json
from gateway.engines.capacity import CapacitySnapshot, RoleView


class BundledAdapter(EngineAdapter):
    async def introspect(self, client: httpx.AsyncClient, *, timeout: float) -> CapacitySnapshot:
        data = await get_json(
            client, self.url("/engine/capacity"), timeout=timeout, headers=self.headers()
        )
        if data.get("schema_version") != CAPACITY_SCHEMA_VERSION:
            raise AdapterError(
                f"capacity schema_version {data.get('schema_version')!r} is not "
                f"{CAPACITY_SCHEMA_VERSION}"
            )
        try:
            report = CapacityReport.model_validate(data)
        except ValidationError as exc:
            raise AdapterError(f"capacity report invalid: {exc.error_count()} errors") from exc
        return snapshot_from_report(report, model=self.check_model(report.model))

    def tokenize_request(self, model: str, body: dict[str, Any]) -> dict[str, Any]:
        return prompt.for_bundled(model, body)


def snapshot_from_report(report: CapacityReport, *, model: str) -> CapacitySnapshot:
    """Every role on the path; the reporting role itself is included even if ``roles`` omits it.

    Fault drills and drift statements of any role count for the whole path.
    """
    views = {role.role.value: _role_view(role) for role in report.roles}
    views.setdefault(
        report.role.value,
        RoleView(
            role=report.role.value,
            pool_tokens=report.pool_tokens,
            max_request_tokens=report.max_request_tokens,
            free_tokens=report.free_pages * report.page_size,
            page_size=report.page_size,
        ),
    )
    faults = dict.fromkeys([*report.faults, *(f for role in report.roles for f in role.faults)])
    drifts = dict.fromkeys(d for d in [report.drift, *(r.drift for r in report.roles)] if d)
    return CapacitySnapshot(
        model=model,
        context_window=report.context_window,
        roles=tuple(views.values()),
        measured=True,
        reported_max_request_tokens=report.max_request_tokens,
        faults=tuple(faults),
        engine_drift="; ".join(drifts) or None,
        unavailable=report.unavailable,
        tokenizer=report.tokenizer,
        features=frozenset(report.features),
    )


def _role_view(role: RoleCapacity) -> RoleView:
    return RoleView(
        role=role.role.value,
        pool_tokens=role.pool_tokens,
        max_request_tokens=role.max_request_tokens,
        free_tokens=role.free_pages * role.page_size,
        page_size=role.page_size,
        age_s=role.age_s,
    )
