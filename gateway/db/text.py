"""Text the database can store: the one definition of what PostgreSQL refuses in a text column.

PostgreSQL (UTF-8) refuses a NUL character in any text value, and no driver can encode a lone
UTF-16 surrogate (JSON may escape one: ``"\\ud800"``). Either in one row used to fail the whole
batch that carried it. Two layers use this module:

- the HTTP edge refuses such text in every request field that reaches storage (``StoredText``: a
  400 naming the field), so a tenant's ``"model": "kvguard-tiny\\u0000"`` never becomes a row;
- writers of rows built from anything else (an engine's error code, say) neutralise it
  (``storable``: each refused character becomes U+FFFD, the value is cut to the column's length),
  so one odd value cannot poison a shared writer.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator

_REFUSED = re.compile("[\x00\ud800-\udfff]")
REPLACEMENT = "\ufffd"


def check_storable(value: str) -> str:
    """``value`` unchanged, or ValueError naming what the database would refuse."""
    found = _REFUSED.search(value)
    if found is None:
        return value
    what = "a NUL character" if found.group() == "\x00" else "a lone surrogate (not Unicode)"
    raise ValueError(f"text holds {what}, which cannot be stored")


def storable(value: str, limit: int | None = None) -> str:
    """``value`` with each refused character replaced by U+FFFD, cut to ``limit`` characters."""
    if _REFUSED.search(value) is not None:
        value = _REFUSED.sub(REPLACEMENT, value)
    return value if limit is None or len(value) <= limit else value[:limit]


StoredText = Annotated[str, AfterValidator(check_storable)]
"""A request field whose text reaches a database row."""
