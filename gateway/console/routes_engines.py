"""Engines: register one, edit an engine group's members, clear a quarantine with a reason.

Every change calls ``gateway.services.operator`` (the admin API's own implementation) with the
channel ``console``, so it is validated like ``POST /admin/engines`` and recorded in the admin
actions (a quarantine's clearing with the operator's reason, in the same transaction). Engines
configured in settings are shown but not edited here: their source is the deployment's config.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import RedirectResponse, Response

from contracts.sql import run_in_session
from gateway.api.schemas_admin import ClearQuarantineIn, EngineIn, MembersIn
from gateway.config import EngineKind
from gateway.console import forms, render, views
from gateway.console.guard import ActionDep, ConsoleRoute, SignedInDep
from gateway.deps import StateDep
from gateway.errors import InvalidRequest
from gateway.services import operator
from gateway.services.actions import Channel

router = APIRouter(prefix=render.ROOT, route_class=ConsoleRoute, include_in_schema=False)
CONSOLE = Channel.CONSOLE
NOTES = {
    "registered": "Engine registered.",
    "members": "Members saved.",
    "cleared": "Quarantine cleared: the engine is routed to again once its capacity is fresh.",
}


def _members(form: dict[str, str]) -> list[dict[str, str]]:
    """The members textarea: one ``name role url`` per line."""
    found = []
    for number, line in enumerate((form.get("members") or "").splitlines(), start=1):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 3:
            message = f"members, line {number}: expected 'name role url'"
            raise InvalidRequest(message, param="members")
        found.append(dict(zip(("name", "role", "url"), parts, strict=True)))
    return found


def _done(note: str) -> Response:
    return RedirectResponse(f"{render.ROOT}/engines?note={note}", status_code=303)


@router.get("/engines")
async def engines(
    request: Request, signed: SignedInDep, state: StateDep, note: str | None = None
) -> Response:
    shown = views.engine_outs(state.registry)
    editable = views.editable(state.registry)
    recent = await run_in_session(state.sessions, lambda s: views.recent_actions(s))
    context: dict[str, Any] = {
        "title": "Engines",
        "section": "engines",
        "engines": shown,
        "actions": recent,
    }
    context |= {"editable": editable, "note": NOTES.get(note or "")}
    context["kinds"] = [kind.value for kind in EngineKind]
    return render.page(request, "engines.html", context, signed=signed)


@router.post("/engines")
async def register(action: ActionDep, state: StateDep) -> Response:
    form = action.form
    body = forms.validated(
        EngineIn,
        {
            "name": forms.text(form, "name") or "",
            "kind": forms.text(form, "kind") or "",
            "base_url": forms.text(form, "base_url") or "",
            "model": forms.text(form, "model"),
            "declared_max_model_len": forms.number(form, "declared_max_model_len"),
            "declared_pool_tokens": forms.number(form, "declared_pool_tokens"),
            "allow_unverified": forms.checked(form, "allow_unverified"),
            "discover_members": forms.checked(form, "discover_members"),
            "api_key_env": forms.text(form, "api_key_env"),
            "members": _members(form),
        },
    )
    spec = operator.engine_spec(body.model_dump())
    await operator.register_engine(state, channel=CONSOLE, spec=spec)
    return _done("registered")


@router.post("/engines/{name}/members")
async def set_members(name: str, action: ActionDep, state: StateDep) -> Response:
    body = forms.validated(MembersIn, {"members": _members(action.form)})
    members = [m.model_dump(exclude_none=True) for m in body.members]
    await operator.set_members(state, channel=CONSOLE, name=name, members=members)
    return _done("members")


@router.post("/engines/{name}/clear")
async def clear_quarantine(name: str, action: ActionDep, state: StateDep) -> Response:
    reason = forms.text(action.form, "reason")
    if reason is None:
        raise InvalidRequest("say why the quarantine may be lifted", param="reason")
    body = forms.validated(ClearQuarantineIn, {"reason": reason})
    await operator.clear_quarantine(state, channel=CONSOLE, name=name, reason=body.reason)
    return _done("cleared")
