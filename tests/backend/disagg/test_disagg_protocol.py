"""The handoff messages and their codec: exact round trips, versions refused first, strict."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from disagg_messages import KEY, LAYOUT, OPEN_TARGET, TARGET, ok_result, request

from backend.core.grammar import GrammarSpec
from backend.disagg.errors import MalformedMessage, ProtocolVersionMismatch
from backend.disagg.protocol import (
    PROTOCOL_VERSION,
    AbortAck,
    AbortRequest,
    DecodeAnnouncement,
    ErrorInfo,
    HandoffOutcome,
    KvLayout,
    SamplingSpec,
    TokenRange,
    abort_ack_from_wire,
    abort_request_from_wire,
    check_version,
    decode_announcement_from_wire,
    prefill_request_from_wire,
    prefill_result_from_wire,
    to_wire,
)


def wire(message: Any) -> Any:
    """Through real JSON, as on the network."""
    return json.loads(json.dumps(to_wire(message)))


def test_every_message_round_trips_exactly() -> None:
    assert prefill_request_from_wire(wire(request())) == request()
    assert prefill_result_from_wire(wire(ok_result())) == ok_result()
    rejected = ok_result(
        outcome=HandoffOutcome.REJECTED,
        error=ErrorInfo("context_length_exceeded", 400, "too long"),
        transferred=None,
        pages_written=(),
        checksum=None,
        first_token=None,
        first_token_logprobs=None,
    )
    assert prefill_result_from_wire(wire(rejected)) == rejected
    plain = request(sampling=SamplingSpec(8, 0.0, 1.0, None, ()))  # no biases, no logprobs
    assert prefill_request_from_wire(wire(plain)) == plain
    any_object = request(
        sampling=SamplingSpec(8, 0.0, 1.0, None, (), grammar=GrammarSpec.json_object())
    )
    assert prefill_request_from_wire(wire(any_object)) == any_object
    assert prefill_result_from_wire(wire(ok_result(first_token_logprobs=None))).first_token == 65
    abort = AbortRequest(PROTOCOL_VERSION, "req-1", "inst-1")
    assert abort_request_from_wire(wire(abort)) == abort
    ack = AbortAck(PROTOCOL_VERSION, "req-1", "inst-1", True, "aborted")
    assert abort_ack_from_wire(wire(ack)) == ack
    for target in (TARGET, OPEN_TARGET):
        announced = DecodeAnnouncement(PROTOCOL_VERSION, target)
        assert decode_announcement_from_wire(wire(announced)) == announced
    opened = request(target=OPEN_TARGET, seal_key=None)
    assert prefill_request_from_wire(wire(opened)) == opened
    assert wire(request())["seal_key"] == KEY.hex()


OTHER_VERSIONS = [
    0,
    PROTOCOL_VERSION - 1,
    PROTOCOL_VERSION + 1,
    str(PROTOCOL_VERSION),
    float(PROTOCOL_VERSION),
    None,
    True,
]


@pytest.mark.parametrize("version", OTHER_VERSIONS)
def test_another_version_is_refused_before_anything_else_is_read(version: Any) -> None:
    for parse, message in [
        (prefill_request_from_wire, request()),
        (prefill_result_from_wire, ok_result()),
        (abort_request_from_wire, AbortRequest(PROTOCOL_VERSION, "r", "i")),
        (abort_ack_from_wire, AbortAck(PROTOCOL_VERSION, "r", "i", True, "x")),
        (decode_announcement_from_wire, DecodeAnnouncement(PROTOCOL_VERSION, TARGET)),
    ]:
        payload = {**wire(message), "protocol_version": version, "future_field": 1}
        with pytest.raises(ProtocolVersionMismatch) as info:
            parse(payload)
        assert info.value.code == "handoff_protocol_mismatch" and info.value.http_status == 503


def test_each_side_checks_against_its_own_version() -> None:
    payload = wire(request())
    newer = PROTOCOL_VERSION + 1
    with pytest.raises(
        ProtocolVersionMismatch, match=f"speaks version {newer}, the peer sent {PROTOCOL_VERSION}"
    ):
        prefill_request_from_wire(payload, local=newer)
    with pytest.raises(ProtocolVersionMismatch):
        check_version({"no": "version"}, "x")
    with pytest.raises(ProtocolVersionMismatch):
        check_version(["not", "a", "dict"], "x")


@pytest.mark.parametrize(
    ("mutate", "problem"),
    [
        (lambda p: p.update(extra=1), "unknown fields ['extra']"),
        (lambda p: p.pop("tenant"), "missing fields ['tenant']"),
        (lambda p: p.update(reserved_tokens="20"), "reserved_tokens must be an integer"),
        (lambda p: p.update(reserved_tokens=True), "reserved_tokens must be an integer"),
        (lambda p: p.update(prompt_ids=[1, -2]), "prompt_ids must be a list"),
        (lambda p: p.update(reserved_tokens=19), "reserved_tokens must equal the prompt"),
        (lambda p: p["pages"].pop(), "1 pages granted for 2 pages of prompt"),
        (lambda p: p["pages"][0].update(generation=0), "generation must be an integer >= 1"),
        (lambda p: p["target"]["layout"].update(dtype="int4"), "unknown dtype"),
        (lambda p: p.update(lease_s=0), "lease_s and max_batch_pages must be positive"),
        (lambda p: p["sampling"].pop("logit_bias"), "missing fields ['logit_bias']"),
        (lambda p: p["sampling"].update(logit_bias=[[65]]), "logit_bias must be a list of"),
        (lambda p: p["sampling"].update(logit_bias=[[-1, 2]]), "logit_bias must be a list of"),
        (lambda p: p["sampling"].update(logit_bias=[["65", 2]]), "logit_bias must be a list of"),
        (lambda p: p["sampling"].update(logprobs=-1), "logprobs must be an integer >= 0"),
        (lambda p: p["sampling"].pop("grammar"), "missing fields ['grammar']"),
        (lambda p: p["sampling"]["grammar"].update(kind="regex"), "unknown kind 'regex'"),
        (lambda p: p["sampling"]["grammar"].update(schema=None), "needs its schema"),
        (lambda p: p["sampling"]["grammar"].update(schema={}), "schema must be a string"),
        (lambda p: p["sampling"]["grammar"].update(strict="yes"), "strict must be a boolean"),
        (lambda p: p.update(seal_key=None), "a seal key comes with a sealed target"),
        (lambda p: p.update(seal_key="ab" * 16), "seal_key must be 32 bytes"),
        (lambda p: p.update(seal_key="zz" * 32), "seal_key must be hex"),
        (lambda p: p["target"].update(channel="plain"), "unknown channel 'plain'"),
        (lambda p: p["target"].update(bases=[4096, 8192]), "the sealed channel has bases: landing"),
        (lambda p: p["target"].update(channel="open"), "the open channel has bases: K pool"),
        (lambda p: p["target"].update(bases=[0]), "the sealed channel has bases"),
    ],
)
def test_malformed_requests_are_refused_not_guessed(mutate: Any, problem: str) -> None:
    payload = wire(request())
    mutate(payload)
    with pytest.raises(MalformedMessage, match=problem.replace("[", r"\[").replace("]", r"\]")):
        prefill_request_from_wire(payload)


@pytest.mark.parametrize(
    "changes",
    [
        {"checksum": None},
        {"transferred": None},
        {"first_token": None},
        {"outcome": HandoffOutcome.FAILED},  # a failure must carry its error
        {"outcome": HandoffOutcome.REJECTED},
    ],
)
def test_results_cannot_claim_an_outcome_without_its_evidence(changes: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ok_result(**changes)


def test_first_token_logprobs_are_strict_and_need_the_token() -> None:
    payload = wire(ok_result())
    payload["first_token_logprobs"]["top"] = [[65, "-0.25"]]
    with pytest.raises(MalformedMessage, match="top must be a list of"):
        prefill_result_from_wire(payload)
    payload = wire(ok_result())
    payload["first_token_logprobs"] = {"logprob": -0.25}
    with pytest.raises(MalformedMessage, match="missing fields \\['top'\\]"):
        prefill_result_from_wire(payload)
    with pytest.raises(ValueError, match="without a first_token"):
        dataclasses.replace(ok_result(), outcome=HandoffOutcome.ABORTED, first_token=None)


def test_an_unknown_outcome_is_malformed() -> None:
    payload = {**wire(ok_result()), "outcome": "done"}  # the legacy word is not an outcome
    with pytest.raises(MalformedMessage, match="unknown outcome 'done'"):
        prefill_result_from_wire(payload)


def test_reprs_leave_out_prompt_tokens_and_the_key() -> None:
    text = repr(request(prompt_ids=(4242,) * 20))
    assert "4242" not in text and "prompt_ids" not in text
    assert KEY.hex() not in text and "seal_key" not in text
    assert "98765" not in repr(ok_result(first_token=98765))
    assert "-0.25" not in repr(ok_result())  # the first token's logprobs show its alternatives


def test_layout_offsets_and_geometry() -> None:
    assert LAYOUT.token_bytes == 2 * 16 * 4
    assert LAYOUT.page_bytes == 16 * 128
    assert LAYOUT.offset(1, 3) == 32 * 2048 + 3 * 2048
    other_pool = KvLayout(2, 99, 16, 2, 16, "float32")
    assert LAYOUT.same_geometry(other_pool)
    assert not LAYOUT.same_geometry(KvLayout(2, 32, 16, 2, 16, "float16"))
    assert not LAYOUT.same_geometry(KvLayout(3, 32, 16, 2, 16, "float32"))
    with pytest.raises(ValueError):
        TokenRange(5, 4)
