"""Grammar-constrained sampling in the engine core, over the bundled model and xgrammar.

- every constrained answer the core produces is complete JSON valid under its schema, ending on
  the stop token (the matcher allows it only there), and the mask's cost is counted;
- the state is rebuilt by replaying outputs (how decode takes over after prefill's first token):
  a request whose matcher is dropped continues to the answer it gives untouched; one whose
  outputs the grammar refuses fails with ``grammar_violation``, its bystanders unharmed;
- a schema xgrammar cannot use is a 400 (``InvalidRequest``) naming ``response_format``;
- a string with ``maxLength`` never holds a control character (xgrammar's own rule lets them
  through; the backend tightens it), so answers always parse.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from backend.config import BackendSettings
from backend.core.errors import InvalidRequest
from backend.core.grammar import GrammarSpec
from backend.core.request import FinishReason, Request, RequestState, SamplingParams
from backend.engine.build import build_engine
from backend.model.tokenizer import BYTE_EOS, ByteTokenizer
from backend.server.structured import schema_spec

SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog"]},
        "tags": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "maxItems": 4,
        },
        "name": {"type": "string", "maxLength": 6},
    },
    "required": ["kind", "tags", "name"],
    "additionalProperties": False,
}
SPEC = schema_spec(SCHEMA, strict=True)


@pytest.fixture(scope="module")
def built(tiny_checkpoint: str):  # type: ignore[no-untyped-def]
    settings = BackendSettings(
        model=tiny_checkpoint, pool_tokens=2048, page_size=16, max_batch_tokens=256, max_running=16
    )
    return build_engine(settings)


def _request(rid: str, seed: int, grammar: GrammarSpec | None = SPEC) -> Request:
    prompt = ByteTokenizer().encode(f"<|user|>\ngently: pet {rid}\n<|assistant|>\nexactly: ")
    sampling = SamplingParams(
        max_tokens=200, temperature=1.0, seed=seed, stop_token_ids=(BYTE_EOS,), grammar=grammar
    )
    return Request(rid, "tenant-a", prompt, sampling)


def _run(built, requests: list[Request]) -> None:  # type: ignore[no-untyped-def]
    core = built.engine.core
    for request in requests:
        core.add(request)
    for _ in range(500):
        if not core.has_work():
            return
        core.step()
    raise AssertionError("the core did not finish")


def _text(request: Request) -> str:
    return ByteTokenizer().decode(request.output_ids)


def test_constrained_answers_are_valid_json_ending_on_stop(built) -> None:  # type: ignore[no-untyped-def]
    grammar = built.grammar
    rows_before = grammar.masked_rows
    requests = [_request(f"r{i}", seed=i) for i in range(16)]
    _run(built, requests)
    for request in requests:
        assert request.state is RequestState.FINISHED, request
        assert request.finish_reason is FinishReason.STOP
        assert request.output_ids[-1] == BYTE_EOS
        jsonschema.validate(json.loads(_text(request)), SCHEMA)
    masked = sum(len(r.output_ids) for r in requests)
    assert grammar.masked_rows - rows_before == masked  # every constrained token was masked
    assert grammar.mask_seconds > 0


def test_state_is_rebuilt_by_replay_and_a_refused_output_fails_the_request(built) -> None:  # type: ignore[no-untyped-def]
    core = built.engine.core
    untouched, rebuilt, refused, bystander = (
        _request("untouched", 7),
        _request("rebuilt", 7),
        _request("refused", 8),
        _request("bystander", 9, grammar=None),
    )
    for request in (untouched, rebuilt, refused, bystander):
        core.add(request)
    core.step()  # prompts computed, first tokens sampled under the grammar
    assert all(r.output_ids for r in (untouched, rebuilt, refused))
    # As on a decode role after the handoff: the state is not there, the first token is.
    rebuilt.grammar = None
    refused.grammar = None
    refused.output_ids[0] = ord("x")  # prefill sampled outside the grammar: JSON starts with "{"
    outcome = core.step()
    assert [r.request_id for r in outcome.failed] == ["refused"]
    assert refused.state is RequestState.FAILED
    assert refused.error is not None and refused.error.code == "grammar_violation"
    _run(built, [])
    assert rebuilt.output_ids == untouched.output_ids  # replay gave the very same state
    jsonschema.validate(json.loads(_text(rebuilt)), SCHEMA)
    assert bystander.state is RequestState.FINISHED


def test_a_schema_that_cannot_compile_is_a_400(built) -> None:  # type: ignore[no-untyped-def]
    bad = schema_spec({"type": "object", "$ref": "#/nowhere"}, strict=True)
    with pytest.raises(InvalidRequest) as caught:
        built.grammar.compile(bad, "tenant-a")
    assert caught.value.param == "response_format" and caught.value.http_status == 400


def test_length_bounded_strings_hold_no_control_characters(built) -> None:  # type: ignore[no-untyped-def]
    """Uniform random logits over the byte vocabulary: control bytes are as likely as letters,
    so xgrammar's loose class would have let one into the name within a few answers."""
    grammar, rng = built.grammar, random.Random(0)
    torch.manual_seed(0)
    for n in range(40):
        request = _request(f"u{n}", seed=n)
        matcher = grammar.state_for(request)
        for _ in range(200):
            logits = torch.rand(1, grammar.vocab_size)
            grammar.mask(logits, [(0, matcher)])
            allowed = torch.nonzero(logits[0] > float("-inf")).flatten().tolist()
            token = rng.choice(allowed)
            assert matcher.accept(token)
            request.output_ids.append(token)
            if matcher.is_terminated:
                break
        assert request.output_ids[-1] == BYTE_EOS
        jsonschema.validate(json.loads(_text(request)), SCHEMA)


def test_compiled_grammars_are_cached_per_tenant(built) -> None:  # type: ignore[no-untyped-def]
    """A cache shared by tenants would answer a schema faster once another tenant had used it
    (an oracle of what others ask for): each tenant's compile is its own."""
    spec = schema_spec({"type": "object", "properties": {"x": {"enum": [7]}}}, strict=True)
    mine = built.grammar.compile(spec, "tenant-a")
    assert built.grammar.compile(spec, "tenant-a") is mine
    assert built.grammar.compile(spec, "tenant-b") is not mine


def test_a_strict_schema_closes_every_object_it_does_not_close_itself(built) -> None:  # type: ignore[no-untyped-def]
    """OpenAI's strict mode: no member a schema does not name. xgrammar's own ``strict_mode``
    closes only objects that list ``properties``, so a strict tool whose parameters are a bare
    ``{"type": "object"}`` got arbitrary arguments (``{"|ype": "object"}`` from the bundled
    model); a random walk under the mask now only ever writes the members named."""
    loose = {
        "type": "object",
        "properties": {"inner": {"type": "object"}, "list": {"items": {"type": "object"}}},
        "required": ["inner", "list"],
    }
    closed = {
        "type": "object",
        "properties": {
            "inner": {"type": "object", "additionalProperties": False},
            "list": {"items": {"type": "object", "additionalProperties": False}},
        },
        "required": ["inner", "list"],
        "additionalProperties": False,
    }
    grammar, rng = built.grammar, random.Random(1)
    for n in range(40):
        request = _request(f"s{n}", seed=n, grammar=schema_spec(loose, strict=True))
        matcher = grammar.state_for(request)
        for _ in range(200):
            logits = torch.zeros(1, grammar.vocab_size)
            grammar.mask(logits, [(0, matcher)])
            token = rng.choice(torch.nonzero(logits[0] > float("-inf")).flatten().tolist())
            assert matcher.accept(token)
            request.output_ids.append(token)
            if matcher.is_terminated:
                break
        assert request.output_ids[-1] == BYTE_EOS, _text(request)
        jsonschema.validate(json.loads(_text(request)), closed)
    assert schema_spec({"type": "object"}, strict=False).schema == '{"type":"object"}'
