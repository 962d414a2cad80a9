"""``Children``: the request path's cached metric children are prometheus_client's own (what
``labels()`` returns), so what the path counts is what ``/metrics`` exposes. ``Tally``: the
request path's updates, applied before any read of the registry sees the metrics."""

from __future__ import annotations

import threading

from prometheus_client import generate_latest

from contracts.metrics import Children, Tally
from gateway.metrics import IN_FLIGHT, REQUESTS_TOTAL, GatewayMetrics


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


def _requests(metrics: GatewayMetrics, tenant: str) -> float | None:
    labels = {"tenant": tenant, "endpoint": "chat", "outcome": "completed", "code": ""}
    return metrics.registry.get_sample_value(REQUESTS_TOTAL, labels)


def test_the_request_path_s_updates_wait_for_a_read_and_every_read_sees_them() -> None:
    metrics = GatewayMetrics()
    later = metrics.later
    later(metrics.requests_of, ("tn_1", "chat", "completed", ""))
    later(metrics.requests_of, ("tn_1", "chat", "completed", ""), 2)
    later(metrics.request_seconds_of, ("chat",), 0.003)
    later(metrics.in_flight_of, ("tn_1",))
    later(metrics.in_flight_of, ("tn_1",), -1)
    later(metrics.in_flight_of, ("tn_1",))
    # nothing applied yet: the children are untouched until the registry is read
    assert metrics.requests_of("tn_1", "chat", "completed", "")._value.get() == 0
    # a read (a scrape's or a test's) applies them first: the registry collects the tally first
    assert _requests(metrics, "tn_1") == 3.0
    assert metrics.registry.get_sample_value(IN_FLIGHT, {"tenant": "tn_1"}) == 1.0
    seconds = "kvguard_gateway_request_duration_seconds"
    assert metrics.registry.get_sample_value(f"{seconds}_sum", {"endpoint": "chat"}) == 0.003
    assert (
        metrics.registry.get_sample_value(f"{seconds}_bucket", {"endpoint": "chat", "le": "0.0025"})
        == 0.0
    )
    assert (
        metrics.registry.get_sample_value(f"{seconds}_bucket", {"endpoint": "chat", "le": "0.005"})
        == 1.0
    )
    exposed = generate_latest(metrics.registry).decode()
    assert 'kvguard_gateway_requests_total{code="",endpoint="chat",outcome="completed",' in exposed
    assert _requests(metrics, "tn_1") == 3.0  # applied once, not again at the next read


def test_a_tally_applies_its_updates_itself_past_its_bound() -> None:
    metrics = GatewayMetrics()
    tally = Tally(fold_at=4)
    for _ in range(3):
        tally.add(metrics.requests_of, ("tn_1", "chat", "completed", ""))
    child = metrics.requests_of("tn_1", "chat", "completed", "")
    assert child._value.get() == 0
    tally.add(metrics.requests_of, ("tn_1", "chat", "completed", ""))
    assert child._value.get() == 4  # the fourth update applied all four: memory stays bounded


def test_updates_added_while_another_thread_reads_are_each_applied_once() -> None:
    metrics = GatewayMetrics()
    done = threading.Event()
    reads = 0

    def scrape() -> None:
        nonlocal reads
        while not done.is_set():
            generate_latest(metrics.registry)
            reads += 1

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for _ in range(20_000):
            metrics.later(metrics.requests_of, ("tn_1", "chat", "completed", ""))
    finally:
        done.set()
        scraper.join()
    assert reads > 0
    assert _requests(metrics, "tn_1") == 20_000.0
