"""What the deployables' metrics share: a labelled metric's children, cached for the request
path (the gateway's and the canary's per-request counters)."""

from __future__ import annotations

from typing import Generic, TypeVar

from prometheus_client import Counter, Gauge, Histogram

M = TypeVar("M", Counter, Gauge, Histogram)


class Children(Generic[M]):
    """A labelled metric's children by their label values (positional, in the metric's label
    order), each asked of prometheus_client once. Its ``labels()`` validates the names, builds a
    tuple of strings and takes a lock on every call -- several times per request on the request
    path; a repeated lookup here is one dict hit and returns the very child ``labels()`` does. It
    holds one entry per child the metric itself holds (the metric keeps every label set it has
    seen), so it grows no further; the gateway never ``remove``s a child of these metrics."""

    __slots__ = ("_metric", "_children")

    def __init__(self, metric: M) -> None:
        self._metric: M = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child
