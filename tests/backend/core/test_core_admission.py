"""Admission: exact limits at the boundary, the drift case, and rejection before any page."""

from __future__ import annotations

import pytest

from backend.core.admission import CapacityLimits, admit
from backend.core.errors import ContextLengthExceeded, InvalidRequest, LimitReason
from backend.core.pages import PagePool


def test_limits_when_pool_covers_the_window() -> None:
    limits = CapacityLimits(page_size=16, pool_pages=512, context_window=4096)
    assert (limits.pool_tokens, limits.max_request_tokens) == (8192, 4096)
    assert limits.drift is None
    assert limits.binding_limit is LimitReason.CONTEXT_WINDOW


def test_limits_when_window_equals_pool() -> None:
    limits = CapacityLimits(page_size=16, pool_pages=256, context_window=4096)
    assert limits.max_request_tokens == 4096
    assert limits.drift is None


def test_drift_window_larger_than_pool_limits_to_the_pool() -> None:
    limits = CapacityLimits(page_size=16, pool_pages=256, context_window=8192)
    assert (limits.pool_tokens, limits.max_request_tokens) == (4096, 4096)
    assert limits.binding_limit is LimitReason.KV_POOL
    assert limits.drift == (
        "context window 8192 exceeds the real KV pool of 4096 tokens (256 pages x 16); "
        "requests are limited to 4096 tokens"
    )


@pytest.mark.parametrize("window", [4096, 8192])
def test_boundary_limit_minus_one_limit_and_plus_one(window: int) -> None:
    limits = CapacityLimits(page_size=16, pool_pages=256, context_window=window)
    admit(4085, 10, limits)  # 4095
    admit(4086, 10, limits)  # 4096: exactly the limit
    with pytest.raises(ContextLengthExceeded) as caught:
        admit(4087, 10, limits)  # 4097
    error = caught.value
    assert (error.limit, error.requested, error.prompt_tokens, error.max_tokens) == (
        4096,
        4097,
        4087,
        10,
    )
    assert (error.pool_tokens, error.context_window) == (4096, window)


def test_drift_rejection_message_names_pool_and_window() -> None:
    limits = CapacityLimits(page_size=16, pool_pages=256, context_window=8192)
    with pytest.raises(ContextLengthExceeded) as caught:
        admit(4990, 10, limits)
    assert str(caught.value) == (
        "This engine's maximum request length is 4096 tokens (real KV pool: 4096, context "
        "window: 8192); the request needs 5000 tokens (4990 prompt + 10 max_tokens)"
    )
    assert caught.value.reason == "kv_pool"
    assert caught.value.http_status == 400


def test_window_smaller_than_pool_is_the_binding_limit() -> None:
    limits = CapacityLimits(page_size=16, pool_pages=512, context_window=4096)
    admit(4000, 96, limits)
    with pytest.raises(ContextLengthExceeded) as caught:
        admit(4000, 97, limits)
    assert (caught.value.limit, caught.value.reason) == (4096, "context_window")


def test_max_tokens_counts_toward_the_limit() -> None:
    limits = CapacityLimits(page_size=4, pool_pages=4, context_window=16)
    admit(1, 15, limits)
    with pytest.raises(ContextLengthExceeded):
        admit(1, 16, limits)


def test_empty_prompt_and_no_output_are_invalid_requests() -> None:
    limits = CapacityLimits(page_size=4, pool_pages=4, context_window=16)
    with pytest.raises(InvalidRequest) as caught:
        admit(0, 4, limits)
    assert (caught.value.param, caught.value.code) == ("prompt", "invalid_request")
    with pytest.raises(InvalidRequest) as caught:
        admit(4, 0, limits)
    assert caught.value.param == "max_tokens"


def test_empty_pool_admits_nothing() -> None:
    limits = CapacityLimits(page_size=4, pool_pages=0, context_window=16)
    assert limits.max_request_tokens == 0
    with pytest.raises(ContextLengthExceeded):
        admit(1, 1, limits)


def test_limits_from_pool_are_measured_not_configured() -> None:
    pool = PagePool(256, 16, zero_on_free=False)
    limits = CapacityLimits.from_pool(pool, 8192)
    assert limits == CapacityLimits(16, 256, 8192)


@pytest.mark.parametrize(("size", "pages", "window"), [(0, 1, 1), (1, -1, 1), (1, 1, 0)])
def test_invalid_capacity_is_refused(size: int, pages: int, window: int) -> None:
    with pytest.raises(ValueError):
        CapacityLimits(size, pages, window)
