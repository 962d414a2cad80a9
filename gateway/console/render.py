"""Server-side rendering of the console: the Jinja2 environment, its filters, one ``page`` helper.

Autoescaping is on for every template and undefined names fail loudly, so no value reaches a page
unescaped and no typo renders as an empty cell. Pages carry no inline script or style (the
console's CSP forbids both): behaviour and looks come from ``static/``.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from starlette.requests import Request
from starlette.responses import HTMLResponse

from contracts.sql import utcnow
from gateway.console.sessions import SignedIn

TEMPLATES = Path(__file__).resolve().with_name("templates")
STATIC = Path(__file__).resolve().with_name("static")
ROOT = "/console"


def _when(value: datetime | None) -> str:
    return "—" if value is None else value.strftime("%Y-%m-%d %H:%M:%S UTC")


def _ago(value: datetime | None) -> str:
    if value is None:
        return ""
    seconds = max(0, int((utcnow() - value).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds // size} {unit} ago"
    return f"{seconds} s ago"


def _num(value: float | int | None) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.2f}"
    return f"{int(value):,}"


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(TEMPLATES),
        autoescape=select_autoescape(default=True, default_for_string=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(when=_when, ago=_ago, num=_num)
    env.globals["root"] = ROOT
    return env


_ENV = _environment()


def page(
    request: Request,
    template: str,
    context: Mapping[str, Any],
    *,
    signed: SignedIn | None,
    status: int = 200,
    headers: Mapping[str, str] | None = None,
) -> HTMLResponse:
    """One rendered page; a signed-in page knows its CSRF token (every form carries it)."""
    values = {
        "section": context.get("section", ""),
        "csrf": signed.csrf if signed is not None else None,
        "signed_in": signed is not None,
        **context,
    }
    html = _ENV.get_template(template).render(values)
    return HTMLResponse(html, status_code=status, headers=dict(headers or {}))
