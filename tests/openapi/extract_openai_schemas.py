"""Regenerate ``openai_schemas.json`` from OpenAI's published OpenAPI description.

    .venv/bin/python tests/openapi/extract_openai_schemas.py /path/to/openai-openapi.yaml

Keeps the component schemas the tests validate against (``ROOTS``; the Responses API's in a
second file, ``RESPONSES_ROOTS`` -> ``openai_responses_schemas.json``) and every schema they reach
through ``$ref``, drops prose (descriptions, examples, titles), and rewrites the OpenAPI 3.0
``nullable: true`` the document mixes into its 3.1 schemas as JSON Schema's "or null", so a plain
Draft 2020-12 validator reads them as OpenAI means them. One schema is derived, not copied
(``completion_chunk``: a streamed completions event). The project never reads the source at run
time; this script is how the fixture was made, and how to refresh it from a newer description.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import yaml

SOURCE = {
    "repository": "https://github.com/openai/openai-openapi",
    "commit": "f85dbe223d40e1a31cba812ab2d755c7e98a92a3",
    "date": "2026-08-21",
    "file": "openai-openapi.yaml",
    "licence": "MIT (LICENSE-openai-openapi in this folder)",
}
ROOTS = (
    "CreateChatCompletionRequest",
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionRequest",
    "CreateCompletionResponse",
    "CreateEmbeddingRequest",
    "CreateEmbeddingResponse",
    "ListModelsResponse",
    "Model",
    "ErrorResponse",
)
RESPONSES_ROOTS = (
    "CreateResponse",
    "Response",
    "ResponseStreamEvent",
    "ResponseItemList",
    "ErrorResponse",
)
DERIVED = "CreateCompletionChunk"  # see completion_chunk
PROSE = frozenset({"description", "example", "examples", "title", "x-oaiMeta", "x-oaiExpandable"})
PREFIX = "#/components/schemas/"
OUT = Path(__file__).with_name("openai_schemas.json")
RESPONSES_OUT = Path(__file__).with_name("openai_responses_schemas.json")


def _refs(node: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(PREFIX):
            found.add(ref.removeprefix(PREFIX))
        for value in node.values():
            found |= _refs(value)
    elif isinstance(node, list):
        for value in node:
            found |= _refs(value)
    return found


def closure(schemas: dict[str, Any], roots: tuple[str, ...]) -> dict[str, Any]:
    kept: dict[str, Any] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in kept:
            continue
        kept[name] = schemas[name]
        todo.extend(sorted(_refs(schemas[name]) - set(kept)))
    return dict(sorted(kept.items()))


def clean(node: Any) -> Any:
    """Prose dropped, ``nullable: true`` turned into "or null" (3.0 -> 3.1 semantics)."""
    if isinstance(node, list):
        return [clean(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: clean(v) for k, v in node.items() if k not in PROSE and k != "nullable"}
    if node.get("nullable") is not True:
        return out
    kind = out.get("type")
    if (
        isinstance(kind, str)
        and "$ref" not in out
        and not any(k in out for k in ("oneOf", "anyOf", "allOf"))
    ):
        out["type"] = [kind, "null"]
        if "enum" in out and None not in out["enum"]:
            out["enum"] = [*out["enum"], None]
        return out
    return {"anyOf": [out, {"type": "null"}]}


def completion_chunk(response: dict[str, Any]) -> dict[str, Any]:
    """The one derived schema: a streamed completions event. The description has no stream
    schema for completions (it streams ``CreateCompletionResponse`` objects) and requires a string
    ``finish_reason``; OpenAI, vLLM and SGLang all send null in every event but the last."""
    chunk = copy.deepcopy(response)
    choice = chunk["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    chunk["x-derived"] = "CreateCompletionResponse with a nullable finish_reason"
    return chunk


def main(source: Path) -> None:
    document = yaml.safe_load(source.read_text(encoding="utf-8"))
    all_schemas = document["components"]["schemas"]
    schemas = {name: clean(schema) for name, schema in closure(all_schemas, ROOTS).items()}
    schemas[DERIVED] = completion_chunk(schemas["CreateCompletionResponse"])
    _write(OUT, schemas, {"roots": list(ROOTS), "derived": [DERIVED]})
    responses = {
        name: clean(schema) for name, schema in closure(all_schemas, RESPONSES_ROOTS).items()
    }
    _write(RESPONSES_OUT, responses, {"roots": list(RESPONSES_ROOTS), "derived": []})


def _write(out: Path, schemas: dict[str, Any], provenance: dict[str, Any]) -> None:
    fixture = {
        "x-provenance": {**SOURCE, **provenance, "tool": Path(__file__).name},
        "components": {"schemas": schemas},
    }
    out.write_text(json.dumps(fixture, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    print(f"{len(schemas)} schemas -> {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
