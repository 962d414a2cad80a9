"""Structured output and tool calls through a real prefill/decode pair of every checkpoint.

Prefill samples each answer's first token under the request's grammar (the spec travels in the
handoff, protocol 3); decode rebuilds the grammar's state from the same spec and replays that
token, then samples the rest. 100 of 100 ``json_schema`` answers validate, streamed and not, and
100 ``tool_choice: "required"`` answers are each one valid call (the cases of
``tests/backend/model/structured_cases.py``), for the bundled model and each tiny family of
the model matrix. One pair per checkpoint, module-scoped.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from disagg_harness import MODEL, decode, prefill, running

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
import structured_cases as cases
from tiny_families import FAMILIES, FAMILY_NAMES, write_family

pytestmark = pytest.mark.slow
# The bundled model, which the production-like stack runs as a pair, and every family of the model
# matrix: each family's tokenizer and chat template decide what the grammar's first token is, and
# that token is what prefill samples and decode replays.
PAIR_FAMILIES: list[str] = list(FAMILY_NAMES)


@pytest.fixture(scope="module", params=["bundled", *PAIR_FAMILIES])
def pair(request, tmp_path_factory, tiny_checkpoint) -> Iterator[str]:  # type: ignore[no-untyped-def]
    name = request.param
    if name == "bundled":
        model = tiny_checkpoint
    else:
        model = str(write_family(FAMILIES[name], tmp_path_factory.mktemp(name)))
    wide = {"KVGUARD_MAX_RUNNING": "128"}
    p = prefill(wide, pool_tokens=4096)
    d = decode(p, wide, pool_tokens=4096)
    with running(model, p, d):
        yield d.url


def test_json_schema_answers_through_the_pair(pair: str) -> None:
    for answers in cases.both_ways(pair, MODEL, cases.schema_body(), 100):
        cases.check_schema_answers(answers, 100)


def test_required_tool_calls_through_the_pair(pair: str) -> None:
    for answers in cases.both_ways(pair, MODEL, cases.required_body(), 50):
        cases.check_required_answers(answers, 50)
