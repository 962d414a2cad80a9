"""Instants a client gives in a query string or body: zoned, and representable in UTC.

``Instant`` is the one type for every ``since``/``until`` filter. A datetime without a zone (or a
bare date) is refused rather than guessed at; so is one whose conversion to UTC leaves the years
``datetime`` can hold (``0001-01-01T00:00:00+05:00``). Both are 400s naming the parameter (through
the app's validation handler), never a 500 from the database layer.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from pydantic import AfterValidator, AwareDatetime


def _in_utc(value: datetime) -> datetime:
    try:
        return value.astimezone(UTC)
    except OverflowError:
        raise ValueError("the instant is outside the years 1-9999 once converted to UTC") from None


Instant = Annotated[AwareDatetime, AfterValidator(_in_utc)]
