"""``gateway.limits.auth_throttle``: failures per address and bucket, each with its budget."""

from __future__ import annotations

from gateway.limits.auth_throttle import Bucket, FailedCredentialThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_full_bucket_refuses_until_it_drains() -> None:
    clock = Clock()
    throttle = FailedCredentialThrottle(capacity=3, window_s=60, clock=clock)
    for _ in range(3):
        assert throttle.retry_after_s("1.2.3.4") is None
        throttle.failed("1.2.3.4")
    assert throttle.retry_after_s("1.2.3.4") == 20  # one failure drains every 60/3 s
    assert throttle.retry_after_s("1.2.3.5") is None
    clock.now = 20
    assert throttle.retry_after_s("1.2.3.4") is None


def test_operator_and_tenant_failures_fill_separate_buckets_with_their_own_budgets() -> None:
    throttle = FailedCredentialThrottle(capacity=2, window_s=60, clock=Clock())
    for _ in range(30):
        throttle.failed("1.2.3.4", bucket=Bucket.TENANT, capacity=30)
    assert throttle.retry_after_s("1.2.3.4", bucket=Bucket.TENANT, capacity=30) == 2
    assert throttle.retry_after_s("1.2.3.4") is None  # the operator's budget is untouched
    throttle.failed("1.2.3.4")
    throttle.failed("1.2.3.4")
    assert throttle.retry_after_s("1.2.3.4") == 30


def test_addresses_are_bounded_longest_idle_first() -> None:
    throttle = FailedCredentialThrottle(capacity=1, window_s=60, max_addresses=2, clock=Clock())
    for address in ("a", "b", "c"):
        throttle.failed(address)
    assert throttle.retry_after_s("a") is None  # dropped
    assert throttle.retry_after_s("c") is not None
