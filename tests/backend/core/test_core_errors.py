"""Typed core errors: stable codes, HTTP statuses, exact messages, details, pickling."""

from __future__ import annotations

import pickle

import pytest

from backend.core.errors import (
    ContextLengthExceeded,
    DuplicateRequestId,
    InvalidRequest,
    InvalidTransition,
    InvariantViolation,
    IsolationError,
    IsolationReason,
    KvguardError,
    LimitReason,
    OutOfPages,
    StepProtocolError,
)

ALL_ERRORS: list[KvguardError] = [
    ContextLengthExceeded(4096, 5000, 4990, 10, LimitReason.KV_POOL, 4096, 8192),
    ContextLengthExceeded(4096, 5000, 4990, 10, "context_window"),
    InvalidRequest("prompt", "must contain at least one token"),
    DuplicateRequestId("req-1"),
    IsolationError("req-1", 7, 3, 4, IsolationReason.STALE_GENERATION),
    IsolationError("req-1", 99, 1, None, IsolationReason.UNKNOWN_PAGE),
    OutOfPages(5, 2),
    InvalidTransition("request", "req-1", "finished", "decoding"),
    StepProtocolError("schedule() twice"),
    InvariantViolation("counts do not add up"),
    KvguardError("unexpected"),
]


def test_codes_and_statuses_are_stable() -> None:
    table = {type(e).__name__: (e.code, e.http_status) for e in ALL_ERRORS}
    assert table == {
        "ContextLengthExceeded": ("context_length_exceeded", 400),
        "InvalidRequest": ("invalid_request", 400),
        "DuplicateRequestId": ("duplicate_request_id", 409),
        "IsolationError": ("kv_isolation_violation", 500),
        "OutOfPages": ("kv_pool_exhausted", 503),
        "InvalidTransition": ("invalid_state_transition", 500),
        "StepProtocolError": ("engine_step_protocol_violation", 500),
        "InvariantViolation": ("internal_invariant_violation", 500),
        "KvguardError": ("internal_error", 500),
    }


def test_context_length_message_states_real_limit_and_request_size() -> None:
    error = ContextLengthExceeded(4096, 5000, 4990, 10, LimitReason.KV_POOL, 4096, 8192)
    assert str(error) == (
        "This engine's maximum request length is 4096 tokens (real KV pool: 4096, context "
        "window: 8192); the request needs 5000 tokens (4990 prompt + 10 max_tokens)"
    )
    assert error.details() == {
        "code": "context_length_exceeded",
        "limit": 4096,
        "requested": 5000,
        "prompt_tokens": 4990,
        "max_tokens": 10,
        "reason": "kv_pool",
        "pool_tokens": 4096,
        "context_window": 8192,
    }


def test_context_length_message_without_capacity_numbers_names_the_reason() -> None:
    error = ContextLengthExceeded(4096, 5000, 4990, 10, "context_window")
    assert str(error) == (
        "This engine's maximum request length is 4096 tokens (bounded by context_window); "
        "the request needs 5000 tokens (4990 prompt + 10 max_tokens)"
    )


def test_isolation_error_carries_ids_and_generations_only() -> None:
    error = IsolationError("req-1", 7, 3, 4, IsolationReason.STALE_GENERATION)
    assert str(error) == (
        "KV isolation check failed for request 'req-1': page 7 expected generation 3, "
        "found 4 (stale_generation)"
    )
    assert error.details() == {
        "code": "kv_isolation_violation",
        "request_id": "req-1",
        "page_id": 7,
        "expected_generation": 3,
        "actual_generation": 4,
        "reason": "stale_generation",
    }


@pytest.mark.parametrize("error", ALL_ERRORS, ids=lambda e: type(e).__name__)
def test_every_error_pickles_with_type_message_and_fields(error: KvguardError) -> None:
    clone = pickle.loads(pickle.dumps(error))
    assert type(clone) is type(error)
    assert str(clone) == str(error)
    assert clone.details() == error.details()
    assert isinstance(clone, KvguardError)
