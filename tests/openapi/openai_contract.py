"""Validate what our OpenAI routes send against OpenAI's published schemas (the fixture).

``openai_schemas.json`` holds the component schemas of OpenAI's OpenAPI description that these
checks use (provenance in the file and in README.md). ``check(name, obj)`` raises an
``AssertionError`` naming every violation; ``check_sse(body, name)`` checks each ``data:`` event
of a stream (an ``error`` event against ``ErrorResponse``) and returns the parsed events.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

FIXTURE = Path(__file__).with_name("openai_schemas.json")


@cache
def _document() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(FIXTURE.read_text(encoding="utf-8"))
    return document


@cache
def _validator(name: str) -> Draft202012Validator:
    document = _document()
    if name not in document["components"]["schemas"]:
        raise KeyError(f"{name} is not in the fixture; add it to ROOTS and regenerate")
    return Draft202012Validator({**document, "$ref": f"#/components/schemas/{name}"})


def request_fields(name: str) -> set[str]:
    """The top-level properties of a published request schema (``allOf`` parts included)."""
    schemas = _document()["components"]["schemas"]

    def props(schema: dict[str, Any]) -> set[str]:
        found = set(schema.get("properties", {}))
        for part in schema.get("allOf", []):
            ref = part.get("$ref")
            found |= props(schemas[ref.rsplit("/", 1)[-1]] if ref else part)
        return found

    return props(schemas[name])


def violations(name: str, obj: Any) -> list[str]:
    return [
        f"{'/'.join(str(p) for p in error.absolute_path) or '<root>'}: {error.message}"
        for error in _validator(name).iter_errors(obj)
    ]


def check(name: str, obj: Any) -> Any:
    problems = violations(name, obj)
    assert not problems, f"not a valid {name}: " + "; ".join(problems)
    return obj


def check_sse(body: bytes | str, name: str) -> list[dict[str, Any]]:
    """Every event of an SSE body: ``[DONE]`` last, each other ``data:`` a valid ``name`` (or a
    valid ``ErrorResponse``). Returns the parsed events (without ``[DONE]``)."""
    text = body.decode() if isinstance(body, bytes) else body
    events: list[dict[str, Any]] = []
    done = False
    for block in text.split("\n\n"):
        lines = block.splitlines()
        data = [line[5:].removeprefix(" ") for line in lines if line.startswith("data:")]
        if not data:
            continue
        payload = "\n".join(data)
        assert not done, "an event after [DONE]"
        if payload == "[DONE]":
            done = True
            continue
        event = json.loads(payload)
        check("ErrorResponse" if "error" in event else name, event)
        events.append(event)
    return events
