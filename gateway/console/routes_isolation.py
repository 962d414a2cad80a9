"""``GET /console``: Isolation now -- is any tenant's data at risk, and what did the stack do?"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from contracts.sql import run_in_session, utcnow
from gateway.console import render, views
from gateway.console.guard import ConsoleRoute, SignedInDep
from gateway.deps import StateDep

router = APIRouter(prefix=render.ROOT, route_class=ConsoleRoute, include_in_schema=False)


@router.get("")
async def isolation(request: Request, signed: SignedInDep, state: StateDep) -> Response:
    engines = views.engine_outs(state.registry)
    now = utcnow()
    shown = await run_in_session(
        state.sessions, lambda s: views.isolation(s, engines=engines, now=now)
    )
    context = {"title": "Isolation now", "section": "isolation", "view": shown, "now": now}
    return render.page(request, "isolation.html", context, signed=signed)
