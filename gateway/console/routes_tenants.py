"""Tenants and keys: list, create, disable/enable, set limits, issue and revoke keys, usage, erase
stored responses.

Every change calls ``gateway.services.operator`` (the admin API's own implementation) with the
channel ``console``, and the posted fields pass the admin API's schemas. A new key is shown once:
in the answer to the form that created it (never stored, never in a URL, ``no-store``); the page
redirects nowhere, so nothing can fetch it again.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request
from sqlalchemy.orm import Session
from starlette.responses import RedirectResponse, Response

from contracts.sql import run_in_session, utcnow
from gateway.api.schemas_admin import KeyCreate, TenantCreate, TenantUpdate
from gateway.console import forms, render, views
from gateway.console.guard import ActionDep, ConsoleRoute, SignedInDep
from gateway.deps import StateDep
from gateway.domain import TenantPlan
from gateway.errors import InvalidRequest
from gateway.lifecycle import TenantStatus
from gateway.services import operator
from gateway.services import tenants as tenant_service
from gateway.services.actions import Channel
from gateway.services.keys import IssuedKey

router = APIRouter(prefix=render.ROOT, route_class=ConsoleRoute, include_in_schema=False)
CONSOLE = Channel.CONSOLE
NOTES = {
    "limits": "Limits saved.",
    "status": "Status changed.",
    "revoked": "Key revoked: the API refuses it from now on.",
    "erased": "Stored responses erased.",
}
DAY_S = 24 * 3600


def _since(window: str) -> tuple[str, datetime | None]:
    if window not in views.WINDOWS:
        window = "24h"
    span = views.WINDOWS[window]
    return window, None if span is None else utcnow() - span


def _limits(form: dict[str, str]) -> dict[str, int | None]:
    return {name: forms.number(form, name) for name in tenant_service.LIMIT_FIELDS}


def _key_shown_once(
    request: Request, action: ActionDep, issued: IssuedKey, tenant_id: str, *, created: bool
) -> Response:
    context: dict[str, Any] = {
        "title": "New key",
        "section": "tenants",
        "key": issued,
        "tenant_id": tenant_id,
    }
    context["created"] = created
    return render.page(request, "key_issued.html", context, signed=action.signed)


@router.get("/tenants")
async def tenants(
    request: Request, signed: SignedInDep, state: StateDep, window: str = "24h"
) -> Response:
    window, since = _since(window)
    rows = await run_in_session(state.sessions, lambda s: views.tenants(s, since=since))
    context: dict[str, Any] = {"title": "Tenants and keys", "section": "tenants", "rows": rows}
    context |= {"window": window, "windows": list(views.WINDOWS)}
    return render.page(request, "tenants.html", context, signed=signed)


@router.post("/tenants")
async def create_tenant(request: Request, action: ActionDep, state: StateDep) -> Response:
    form = action.form
    body = forms.validated(
        TenantCreate,
        {
            "name": forms.text(form, "name") or "",
            **_limits(form),
            "canary_sample_rate": forms.fraction(form, "canary_sample_rate") or 0.0,
            "synthetic": forms.checked(form, "synthetic"),
            "key_name": forms.text(form, "key_name"),
        },
    )
    plan = TenantPlan(**{name: getattr(body, name) for name in tenant_service.LIMIT_FIELDS})

    def create(session: Session) -> tuple[str, IssuedKey]:
        created = operator.create_tenant(
            session,
            channel=CONSOLE,
            name=body.name,
            plan=plan,
            synthetic=body.synthetic,
            canary_sample_rate=body.canary_sample_rate,
            key_name=body.key_name,
        )
        return created.tenant.id, created.first_key

    tenant_id, issued = await run_in_session(state.sessions, create)
    return _key_shown_once(request, action, issued, tenant_id, created=True)


@router.get("/tenants/{tenant_id}")
async def tenant(
    request: Request,
    tenant_id: str,
    signed: SignedInDep,
    state: StateDep,
    window: str = "24h",
    note: str | None = None,
) -> Response:
    window, since = _since(window)
    shown = await run_in_session(
        state.sessions, lambda s: views.tenant(s, ref=tenant_id, since=since)
    )
    context: dict[str, Any] = {"title": shown.row.tenant.name, "section": "tenants", "view": shown}
    context |= {"window": window, "windows": list(views.WINDOWS), "note": NOTES.get(note or "")}
    return render.page(request, "tenant.html", context, signed=signed)


def _back_to(tenant_id: str, note: str) -> Response:
    return RedirectResponse(f"{render.ROOT}/tenants/{quote(tenant_id)}?note={note}", 303)


@router.post("/tenants/{tenant_id}/limits")
async def set_limits(tenant_id: str, action: ActionDep, state: StateDep) -> Response:
    form = action.form
    rate = forms.fraction(form, "canary_sample_rate")
    body = forms.validated(TenantUpdate, {**_limits(form), "canary_sample_rate": rate})
    limits = {name: getattr(body, name) for name in tenant_service.LIMIT_FIELDS}
    canary = (body.canary_sample_rate, None) if body.canary_sample_rate is not None else None
    await run_in_session(
        state.sessions,
        lambda s: operator.update_tenant(
            s, channel=CONSOLE, ref=tenant_id, limits=limits, canary=canary
        ),
    )
    return _back_to(tenant_id, "limits")


@router.post("/tenants/{tenant_id}/status")
async def set_status(tenant_id: str, action: ActionDep, state: StateDep) -> Response:
    try:
        status = TenantStatus(action.form.get("status", ""))
    except ValueError as exc:
        raise InvalidRequest("status must be active or disabled", param="status") from exc
    await run_in_session(
        state.sessions,
        lambda s: operator.update_tenant(s, channel=CONSOLE, ref=tenant_id, status=status),
    )
    return _back_to(tenant_id, "status")


@router.post("/tenants/{tenant_id}/responses/erase")
async def erase_responses(tenant_id: str, action: ActionDep, state: StateDep) -> Response:
    await run_in_session(
        state.sessions,
        lambda s: operator.erase_responses(s, channel=CONSOLE, ref=tenant_id),
    )
    return _back_to(tenant_id, "erased")


@router.post("/tenants/{tenant_id}/keys")
async def issue_key(
    request: Request, tenant_id: str, action: ActionDep, state: StateDep
) -> Response:
    days = forms.number(action.form, "expires_in_days")
    lifetime = None if days is None else days * DAY_S
    body = forms.validated(
        KeyCreate, {"name": forms.text(action.form, "name"), "expires_in_s": lifetime}
    )
    expires_in_s = body.expires_in_s
    expires_at = None if expires_in_s is None else utcnow() + timedelta(seconds=expires_in_s)
    issued = await run_in_session(
        state.sessions,
        lambda s: operator.issue_key(
            s, channel=CONSOLE, ref=tenant_id, name=body.name, expires_at=expires_at
        ),
    )
    return _key_shown_once(request, action, issued, issued.tenant_id, created=False)


@router.post("/keys/{prefix}/revoke")
async def revoke_key(prefix: str, action: ActionDep, state: StateDep) -> Response:
    tenant_id = await run_in_session(
        state.sessions,
        lambda s: operator.revoke_key(s, channel=CONSOLE, prefix=prefix).tenant_id,
    )
    return _back_to(tenant_id, "revoked")
