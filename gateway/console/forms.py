"""Reading a console form: the URL-encoded body, then typed values for the services.

Browsers post ``application/x-www-form-urlencoded``; anything else is refused. Values arrive as
text: an empty field means "not set", numbers are parsed here, and the admin API's own schemas
(``gateway.api.schemas_admin``) validate the result, so the console accepts exactly what the API
does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar
from urllib.parse import parse_qsl

from pydantic import BaseModel, ValidationError

from gateway.errors import InvalidRequest

M = TypeVar("M", bound=BaseModel)
FORM_TYPE = "application/x-www-form-urlencoded"
MAX_FIELDS = 100


def parse_form(body: bytes, content_type: str | None) -> dict[str, str]:
    """The fields of a posted form (a field sent twice is refused: no guessing which counts)."""
    if (content_type or "").split(";")[0].strip().lower() != FORM_TYPE:
        raise InvalidRequest(f"a console form is sent as {FORM_TYPE}")
    try:
        text = body.decode("utf-8")
        pairs = parse_qsl(text, keep_blank_values=True, max_num_fields=MAX_FIELDS, errors="strict")
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest("the form could not be read") from exc
    fields: dict[str, str] = {}
    for name, value in pairs:
        if name in fields:
            raise InvalidRequest(f"the form field {name!r} was sent twice", param=name)
        fields[name] = value
    return fields


def text(form: Mapping[str, str], name: str) -> str | None:
    """A text field, stripped; None when empty or absent."""
    value = form.get(name, "").strip()
    return value or None


def number(form: Mapping[str, str], name: str) -> int | None:
    value = text(form, name)
    if value is None:
        return None
    try:
        return int(value.replace(",", "").replace("_", ""))
    except ValueError as exc:
        raise InvalidRequest(f"{name} must be a whole number", param=name) from exc


def fraction(form: Mapping[str, str], name: str) -> float | None:
    value = text(form, name)
    if value is None:
        return None
    try:
        return float(value)
    except ValueError as exc:
        raise InvalidRequest(f"{name} must be a number", param=name) from exc


def checked(form: Mapping[str, str], name: str) -> bool:
    return name in form


def validated(model: type[M], values: Mapping[str, object]) -> M:
    """``values`` through one of the admin API's schemas; its first complaint as a 400."""
    try:
        return model.model_validate(dict(values))
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(part) for part in first.get("loc", ())) or None
        raise InvalidRequest(f"{param or 'form'}: {first['msg']}", param=param) from exc
