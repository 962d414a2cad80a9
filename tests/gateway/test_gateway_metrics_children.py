"""``Children``: the request path's cached metric children are prometheus_client's own (what
``labels()`` returns), so what the path counts is what ``/metrics`` exposes."""

from __future__ import annotations

from contracts.metrics import Children
from gateway.metrics import REQUESTS_TOTAL, GatewayMetrics


def test_a_cached_child_is_the_metric_s_own_and_its_counts_are_exposed() -> None:
    metrics = GatewayMetrics()
    child = metrics.requests_of("tn_1", "chat", "completed", "")
    assert child is metrics.requests.labels(
        tenant="tn_1", endpoint="chat", outcome="completed", code=""
    )
    assert metrics.requests_of("tn_1", "chat", "completed", "") is child
    child.inc()
    metrics.requests_of("tn_1", "chat", "completed", "").inc(2)
    metrics.requests_of("tn_2", "chat", "completed", "").inc()
    labels = {"tenant": "tn_1", "endpoint": "chat", "outcome": "completed", "code": ""}
    assert metrics.registry.get_sample_value(REQUESTS_TOTAL, labels) == 3.0
    labels["tenant"] = "tn_2"
    assert metrics.registry.get_sample_value(REQUESTS_TOTAL, labels) == 1.0


def test_histogram_children_observe_into_the_exposed_series() -> None:
    metrics = GatewayMetrics()
    children = Children(metrics.request_seconds)
    children("chat").observe(0.002)
    children("chat").observe(0.004)
    count = metrics.registry.get_sample_value(
        "kvguard_gateway_request_duration_seconds_count", {"endpoint": "chat"}
    )
    assert count == 2.0
