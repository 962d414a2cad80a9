"""What a constrained request's output must match, and the state that tracks it.

A ``GrammarSpec`` is the constraint itself, as data: a JSON schema (``response_format``
``json_schema``, or the arguments of the tools a ``tool_choice`` forces) or any JSON object
(``json_object``). It is part of ``SamplingParams``, so it travels wherever sampling does: into
the prefill handoff (``backend.disagg.protocol.SamplingSpec``), through preemption and the prefix
cache (neither touches sampling). Two specs are equal exactly when they constrain alike, which
makes a spec the key of the compiled-grammar cache.

A ``GrammarState`` is the matcher of one request: which tokens may come next given the ones
generated so far. It is kept on the ``Request`` (``Request.grammar``) and built from the spec by
the runner the first time the request samples, replaying every output token the request already
has. That one rule covers every way a request can arrive at a sampling step:
- a new request (no outputs: nothing to replay);
- a preempted one (its outputs stay, and so does its state: nothing is replayed twice);
- a decode-role request whose first token prefill sampled under the same spec: decode rebuilds
  the state and replays that token; a token the grammar does not accept fails the request
  (``GrammarViolation``), it never becomes part of an answer.
Nothing of the grammar travels with the KV: the spec does, and the state is rebuilt from it.

Pure: no torch, no xgrammar (``backend.engine.grammar`` implements the state).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from backend.core.errors import InvalidRequest, KvguardError


class GrammarKind(StrEnum):
    JSON_SCHEMA = "json_schema"  # the output is a JSON value valid under `schema`
    JSON_OBJECT = "json_object"  # the output is any JSON object


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A constraint on the whole completion. ``schema`` is compact JSON text for JSON_SCHEMA
    (keys in the client's order: properties are generated in it), None for JSON_OBJECT;
    ``strict``: properties a schema does not name are refused (OpenAI's ``strict: true``), else
    JSON Schema's own default (allowed unless the schema says ``additionalProperties: false``)."""

    kind: GrammarKind
    schema: str | None = None
    strict: bool = True

    def __post_init__(self) -> None:
        if (self.kind is GrammarKind.JSON_SCHEMA) != (self.schema is not None):
            raise ValueError("a json_schema grammar needs its schema, a json_object one has none")

    @classmethod
    def json_schema(cls, schema: str, *, strict: bool) -> GrammarSpec:
        """``schema``: the JSON text of a schema object (serialized by the caller, compactly)."""
        if not schema.startswith("{"):
            raise InvalidRequest("response_format", "the schema must be a JSON object")
        return cls(GrammarKind.JSON_SCHEMA, schema, strict)

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls(GrammarKind.JSON_OBJECT)

    def __repr__(self) -> str:  # a schema can be long; its size says enough in logs
        size = 0 if self.schema is None else len(self.schema)
        return f"GrammarSpec({self.kind.value}, schema={size} chars, strict={self.strict})"


class GrammarState(Protocol):
    """One request's matcher (``backend.engine.grammar``)."""

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and no change) if the grammar refuses it."""

    @property
    def is_terminated(self) -> bool:
        """The output is complete and its stop token was accepted."""


class GrammarViolation(KvguardError):
    """A token the request's grammar does not allow was about to become part of its answer (a
    prefill that sampled outside the grammar, or an engine bug). The request fails; the answer is
    never sent as if it matched."""

    code = "grammar_violation"
    http_status = 500

    def __init__(self, request_id: str, position: int) -> None:
        super().__init__(
            f"request {request_id}: output token {position} is not allowed by its grammar",
            request_id,
            position,
        )
