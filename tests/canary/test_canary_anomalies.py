"""The lower-severity checks, exactly: usage against the gateway's count, first-token speed."""

from __future__ import annotations

import pytest

from canary.anomalies import FirstTokenCalibrator, usage_anomaly


def test_usage_against_an_exact_count_flags_any_difference() -> None:
    assert usage_anomaly(gateway_count=120, engine_count=120, exact=True) is None
    assert usage_anomaly(gateway_count=120, engine_count=1, exact=True).detail == (
        "gateway counted 120 prompt tokens (exact), engine reported 1"
    )
    assert usage_anomaly(gateway_count=120, engine_count=121, exact=True) is not None


def test_usage_against_an_upper_bound_flags_only_more() -> None:
    assert usage_anomaly(gateway_count=120, engine_count=40, exact=False) is None
    assert usage_anomaly(gateway_count=120, engine_count=900, exact=False).detail == (
        "gateway counted 120 prompt tokens (upper bound), engine reported 900"
    )


def calibrator() -> FirstTokenCalibrator:
    return FirstTokenCalibrator(min_prompt_tokens=100, ratio=0.2, history=10, min_samples=5)


def test_first_token_calibrates_per_engine_then_flags_the_implausibly_fast() -> None:
    c = calibrator()
    # 100 us/token (idle) and slower (queued behind other requests): the engine's history.
    for tokens, us in ((100, 100), (200, 400), (400, 100), (800, 900), (1600, 250)):
        assert c.observe("e1", prompt_tokens=tokens, first_token_s=tokens * us * 1e-6) is None
    assert c.samples("e1") == 5
    # 1000 tokens answered in 10 ms: 10 us/token, 0.1 of the fast end: a skipped prefill.
    fast = c.observe("e1", prompt_tokens=1000, first_token_s=0.010)
    assert fast is not None and fast.detail == (
        "first token after 10.0 ms for 1000 prompt tokens; this engine's fast end is 100.0 "
        "us/token, this request 10.00 us/token"
    )
    assert c.samples("e1") == 6  # learnt all the same: a lasting change stops being flagged
    assert c.observe("e1", prompt_tokens=1000, first_token_s=0.0021) is None  # 0.21 of 10 us
    # Another engine has its own history: nothing to judge against yet.
    assert c.observe("e2", prompt_tokens=1000, first_token_s=0.001) is None
    # Short prompts are never judged (fixed overheads dominate them).
    assert c.observe("e1", prompt_tokens=99, first_token_s=0.0) is None


def test_history_is_bounded_and_adapts_to_a_faster_engine() -> None:
    c = calibrator()
    for _ in range(10):
        assert c.observe("e1", prompt_tokens=100, first_token_s=0.1) is None  # 1 ms/token
    flagged = [c.observe("e1", prompt_tokens=100, first_token_s=0.01) for _ in range(10)]
    assert [f is not None for f in flagged] == [True] + [False] * 9  # reported once, then learnt
    assert c.samples("e1") == 10
    with pytest.raises(ValueError):
        FirstTokenCalibrator(min_prompt_tokens=1, ratio=1.5, history=10, min_samples=5)
