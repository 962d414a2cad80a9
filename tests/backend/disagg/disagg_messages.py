"""Sample handoff messages shared by the pure disaggregation tests."""

from __future__ import annotations

from typing import Any

from backend.core.grammar import GrammarSpec
from backend.core.messages import TokenLogprobs
from backend.disagg.protocol import (
    PROTOCOL_VERSION,
    HandoffOutcome,
    KvChannel,
    KvLayout,
    PageGrant,
    PrefillRequest,
    PrefillResult,
    SamplingSpec,
    TokenRange,
    TransferTarget,
)

LAYOUT = KvLayout(
    num_layers=2, num_pages=32, page_size=16, num_kv_heads=2, head_dim=16, dtype="float32"
)
TARGET = TransferTarget("127.0.0.1:1234", "inst-1", KvChannel.SEALED, (4096,), LAYOUT, 8)
OPEN_TARGET = TransferTarget("127.0.0.1:1234", "inst-1", KvChannel.OPEN, (4096, 8192), LAYOUT, 8)
KEY = bytes(range(32))
GRANTS = (PageGrant(3, 1), PageGrant(7, 4))


GRAMMAR = GrammarSpec.json_schema('{"type":"object","properties":{"a":{"enum":[1]}}}', strict=True)


def request(**changes: Any) -> PrefillRequest:
    fields: dict[str, Any] = {
        "protocol_version": PROTOCOL_VERSION,
        "request_id": "req-1",
        "tenant": "tenant-a",
        "prompt_ids": tuple(range(20)),
        "sampling": SamplingSpec(8, 0.0, 1.0, 42, (257,), ((65, 2.5), (66, -100.0)), 3, GRAMMAR),
        "reserved_tokens": 20,
        "pages": GRANTS,
        "target": TARGET,
        "lease_s": 30.0,
        "seal_key": KEY,
    }
    return PrefillRequest(**{**fields, **changes})


def ok_result(**changes: Any) -> PrefillResult:
    fields: dict[str, Any] = {
        "protocol_version": PROTOCOL_VERSION,
        "request_id": "req-1",
        "instance_id": "inst-1",
        "outcome": HandoffOutcome.OK,
        "error": None,
        "transferred": TokenRange(0, 20),
        "pages_written": GRANTS,
        "checksum": "sha256:abc",
        "first_token": 65,
        "transfer_s": 0.002,
        "checksum_s": 0.001,
        "first_token_logprobs": TokenLogprobs(-0.25, ((65, -0.25), (66, -1.5), (7, -3.0))),
    }
    if changes.get("first_token", fields["first_token"]) is None:
        fields["first_token_logprobs"] = None  # no token, so none of its logprobs
    return PrefillResult(**{**fields, **changes})
