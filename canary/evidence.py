"""Whether a marker found in an answer could have come from the request itself.

A marker in an answer is evidence of a leak only if the engine produced it from another
request's data. A tenant that holds marker text (its own, seen in a side field; a colluding
tenant's) could send it in, plainly or disguised, and have a model that follows instructions
write it back: the firewall still cuts such an answer (no marker is delivered), but no quarantine
may follow from it. ``input_echo`` looks for the marker's text in everything the request sent --
every string of its body, in document order -- in each of these forms:

- as sent (``plain``), and folded as the firewall reads answers (``folded``,
  ``canary.folding``: lowercase, spaced out, dotted, barred, split by zero-width characters or
  the digits a marker never holds, full-width letters, accents and combining marks); the body's
  strings -- keys included, since an engine writes a tool's parameter names and a response
  schema's property names back -- are joined first, in document order, without the schema's own
  words (keys such as ``role`` and ``content``, values such as roles and part types), so a
  marker split across fields or messages in their order is whole again. ``fold_flat`` is
  ``fold`` of ``canary.folding`` without positions, so every form in which the firewall
  recognises a marker in an answer is a form found here;
- ``reversed``: the folded text read backwards;
- ``base64`` (standard or URL-safe, padded or not) and ``hex``: each run of 16+ such characters
  decoded, and the decoded text looked at folded and reversed in turn.

A match is any ``WINDOW`` (8) consecutive characters of the marker's body -- its whole tenant
tag, or any other 8 -- so a partial copy counts too. By chance, 8 given characters occur at a
given place of folded text with probability 32**-8 (9.1e-13): a 1 MB request falsely matches one
of a marker's 25 windows, either way round, about once in 22,000 requests, and the cost of that is
a replay finding instead of a quarantine.

Not detected (the limits ``canary/README.md`` states): pieces shorter than 8 characters sent out
of order (fields shuffled, a piece per field), other encodings (base32 of the payload, ROT13,
a cipher, a description in words), and two requests that each hold half. Pure: no I/O.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Iterator
from typing import Any

from canary.folding import fold_flat

WINDOW = 8
_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_-]{16,}={0,2}")
_HEX_RUN = re.compile(r"(?:[0-9A-Fa-f]{2}){8,}")
MAX_DECODED_RUNS = 1000  # per request: bounded work however a request is built


# The words the API schema itself puts between the texts a client writes, left out of the joined
# text so that a marker split over messages in order is joined back whole: values (roles, part
# types) and keys (the fields of messages, content parts and tool calls). Left out only when a
# whole string is one of them; every other key is read, as the engine may write it back (a tool's
# parameter name, a response schema's property name).
SCHEMA_WORDS = frozenset(
    {"system", "developer", "user", "assistant", "tool", "function", "text", "image_url"}
)
SCHEMA_KEYS = frozenset(
    {
        "messages",
        "role",
        "content",
        "type",
        "text",
        "name",
        "prompt",
        "input",
        "instructions",
        "tool_calls",
        "tool_call_id",
        "call_id",
        "function",
        "arguments",
        "id",
        "image_url",
        "url",
        "detail",
        "refusal",
        "summary",
        "output",
    }
)


def strings_of(value: Any) -> Iterator[str]:
    """Every string of a parsed JSON body in document order, keys included (each before its
    value), schema words left out. Iterative: a body nested as deep as its parser allows costs no
    recursion here."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if item not in SCHEMA_WORDS:
                yield item
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                stack.append(child)
                if key not in SCHEMA_KEYS:
                    stack.append(key)  # JSON keys are strings; read like a value
        elif isinstance(item, list):
            stack.extend(reversed(item))


def fold(text: str) -> str:
    """The marker characters of ``text``, folded as the firewall reads answers."""
    return fold_flat(text)


def input_echo(body: Any, marker_body: str) -> str | None:
    """The form in which ``body`` (a request) holds part of ``marker_body`` (a marker's characters
    after ``CNRY-``, or at least its tag), or None when no detected form does."""
    windows = _windows(marker_body)
    if not windows:
        return None
    texts = list(strings_of(body))
    joined = "".join(texts)
    if any(w in joined for w in windows):
        return "plain"
    for form, text in _forms(joined, texts):
        folded = fold(text)
        if any(w in folded for w in windows):
            return form
        if any(w in folded[::-1] for w in windows):
            return "reversed" if form == "folded" else f"{form}+reversed"
    return None


def _windows(marker_body: str) -> set[str]:
    body = fold(marker_body)
    return {body[i : i + WINDOW] for i in range(0, len(body) - WINDOW + 1)}


def _forms(joined: str, texts: list[str]) -> Iterator[tuple[str, str]]:
    """The joined text, then each encoded run of each text decoded (runs are looked for in one
    text at a time: joining would glue neighbours onto them)."""
    yield "folded", joined
    runs = 0
    for text in texts:
        for match in _HEX_RUN.finditer(text):
            if (runs := runs + 1) > MAX_DECODED_RUNS:
                return
            yield "hex", bytes.fromhex(match.group()).decode("utf-8", "replace")
        for match in _BASE64_RUN.finditer(text):
            if (runs := runs + 1) > MAX_DECODED_RUNS:
                return
            decoded = _base64(match.group())
            if decoded is not None:
                yield "base64", decoded


def _base64(run: str) -> str | None:
    text = run.rstrip("=")
    padded = text + "=" * (-len(text) % 4)
    url_safe = "-" in text or "_" in text
    decoders = (base64.urlsafe_b64decode,) if url_safe else (base64.b64decode,)
    for decode in decoders:
        try:
            return decode(padded).decode("utf-8", "replace")
        except (binascii.Error, ValueError):
            continue
    return None
