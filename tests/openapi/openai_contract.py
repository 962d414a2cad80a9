"""Validate what our OpenAI routes send against OpenAI's published schemas (the fixture).

``openai_schemas.json`` holds the component schemas of OpenAI's OpenAPI description that these
checks use (provenance in the file and in README.md); ``openai_responses_schemas.json`` those of the
Responses API. ``check(name, obj)`` raises an ``AssertionError`` naming every violation (a name is
looked up in the first file, then in the second); ``check_sse(body, name)`` checks each ``data:``
event of a stream (an ``error`` event against ``ErrorResponse``) and returns the parsed events;
``check_response_events(body)`` does the same for a Responses stream (each event against the
schema of its ``type`` and against ``ResponseStreamEvent``, ``event:`` lines naming that type,
sequence numbers 0, 1, 2, ...).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

FIXTURE = Path(__file__).with_name("openai_schemas.json")
RESPONSES_FIXTURE = Path(__file__).with_name("openai_responses_schemas.json")


@cache
def _document(fixture: Path = FIXTURE) -> dict[str, Any]:
    document: dict[str, Any] = json.loads(fixture.read_text(encoding="utf-8"))
    return document


@cache
def _validator(name: str) -> Draft202012Validator:
    for fixture in (FIXTURE, RESPONSES_FIXTURE):
        document = _document(fixture)
        if name in document["components"]["schemas"]:
            return Draft202012Validator({**document, "$ref": f"#/components/schemas/{name}"})
    raise KeyError(f"{name} is not in the fixtures; add it to ROOTS and regenerate")


def request_fields(name: str) -> set[str]:
    """The top-level properties of a published request schema (``allOf`` parts included)."""
    schemas = {
        **_document(RESPONSES_FIXTURE)["components"]["schemas"],
        **_document()["components"]["schemas"],
    }

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


@cache
def _event_schemas() -> dict[str, str]:
    """Responses stream event type -> the name of its schema."""
    schemas = _document(RESPONSES_FIXTURE)["components"]["schemas"]
    found = {}
    for option in schemas["ResponseStreamEvent"]["anyOf"]:
        name = option["$ref"].rsplit("/", 1)[-1]
        found[schemas[name]["properties"]["type"]["enum"][0]] = name
    return found


def check_response_event(event: dict[str, Any]) -> dict[str, Any]:
    """One Responses stream event, against the schema of its type and ``ResponseStreamEvent``."""
    name = _event_schemas().get(event.get("type"))
    assert name is not None, f"not a published event type: {event.get('type')!r}"
    check(name, event)
    return check("ResponseStreamEvent", event)


def check_response_events(body: bytes | str) -> list[dict[str, Any]]:
    """Every event of a Responses SSE body, checked (see the module docstring); the events."""
    text = body.decode() if isinstance(body, bytes) else body
    events: list[dict[str, Any]] = []
    for block in text.split("\n\n"):
        lines = block.splitlines()
        data = [line[5:].removeprefix(" ") for line in lines if line.startswith("data:")]
        if not data:
            continue
        event = json.loads("\n".join(data))
        names = [line[6:].strip() for line in lines if line.startswith("event:")]
        assert names in ([], [event.get("type")]), f"event line {names} for {event.get('type')}"
        assert event.get("sequence_number") == len(events), "sequence numbers are not 0, 1, 2..."
        events.append(check_response_event(event))
    return events
