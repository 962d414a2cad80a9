"""The operator console at ``/console``: the deployment's isolation state at a glance, in a browser.

Server-rendered (Jinja2 templates in ``templates/``, one stylesheet and one small script in
``static/``, all shipped in the package: nothing comes from a CDN and nothing needs building).

A console request, in order:

1. ``guard.ConsoleRoute`` wraps the route: whatever happens, the answer is a page with the
   security headers (a strict CSP), never a traceback;
2. ``guard.SignedInDep``: the session cookie names a live session in the database
   (``sessions``); otherwise a page redirects to ``/console/login`` and an action gets a 401.
   Bearer credentials -- tenant keys, the admin token -- sign nothing in here;
3. an action (a POST) is also checked by ``guard.ActionDep``: sent by a console page of the same
   origin, with the session's CSRF token;
4. reads come from the registry and the database (``views``); changes go through
   ``gateway.services.operator``, the admin API's own implementation, and are recorded in the
   admin actions under the channel ``console``;
5. ``render.page`` renders the template.

Pages: Isolation now (``routes_isolation``), Tenants and keys (``routes_tenants``), Engines
(``routes_engines``); signing in and out: ``routes_auth``. The sign-in page and the static assets
are the only console paths served without a session.
"""

from __future__ import annotations

import os

from fastapi import FastAPI
from starlette.responses import Response
from starlette.staticfiles import PathLike, StaticFiles
from starlette.types import Scope

from gateway.console import routes_auth, routes_engines, routes_isolation, routes_tenants
from gateway.console.guard import SECURITY_HEADERS
from gateway.console.render import ROOT, STATIC

STATIC_PATH = f"{ROOT}/static"


class ConsoleStatic(StaticFiles):
    """The console's own assets, with the same headers as its pages."""

    def file_response(
        self,
        full_path: PathLike,
        stat_result: os.stat_result,
        scope: Scope,
        status_code: int = 200,
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers.update(SECURITY_HEADERS)
        response.headers["Cache-Control"] = "no-cache"
        return response


def mount_console(app: FastAPI) -> None:
    """Serve the console at ``/console`` on ``app`` (its state is the gateway's)."""
    for module in (routes_auth, routes_isolation, routes_tenants, routes_engines):
        app.include_router(module.router)
    app.mount(STATIC_PATH, ConsoleStatic(directory=STATIC), name="console-static")
