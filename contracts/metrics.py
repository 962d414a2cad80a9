"""What the deployables' metrics share: a labelled metric's children, cached for the request
path (the gateway's and the canary's per-request counters), and the request path's updates
applied when the registry is read (``Tally``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.registry import Collector

M = TypeVar("M", Counter, Gauge, Histogram)
FOLD_AT = 1024  # updates a tally holds before it applies them itself


class Children(Generic[M]):
    """A labelled metric's children by their label values (positional, in the metric's label
    order), each asked of prometheus_client once. Its ``labels()`` validates the names, builds a
    tuple of strings and takes a lock on every call -- several times per request on the request
    path; a repeated lookup here is one dict hit and returns the very child ``labels()`` does. It
    holds one entry per child the metric itself holds (the metric keeps every label set it has
    seen), so it grows no further; the gateway never ``remove``s a child of these metrics."""

    __slots__ = ("_metric", "_children", "_observes")

    def __init__(self, metric: M) -> None:
        self._metric: M = metric
        self._children: dict[tuple[str, ...], M] = {}
        self._observes = isinstance(metric, Histogram)

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child

    def apply(self, values: tuple[str, ...], amount: float) -> None:
        """Add ``amount`` to the child of ``values`` (a histogram observes it; a gauge goes down
        by a negative one)."""
        child: Any = self(*values)
        if self._observes:
            child.observe(amount)
        else:
            child.inc(amount)


class Tally(Collector):
    """The request path's metric updates, kept as they happen and applied when the registry is
    read. A request used to update about ten children one by one at its exit -- a dict lookup, a
    lock and, for a histogram, a bucket search each, on objects no other part of the request
    touches (cold in every cache at 100 requests/s); now it appends one tuple per update, and the
    updates are applied together, in a loop whose objects stay warm. Register it in the registry
    *before* the metrics it updates: a registry collects in registration order, so every read of
    the registry (a scrape, ``get_sample_value``) applies what is pending first and sees every
    request that has ended, exactly as if each had updated its children at once. Bounded: past
    ``fold_at`` pending updates ``add`` applies them itself. ``add`` and the application may run
    in different threads (a scrape in another thread): a deque's append and popleft are atomic,
    so nothing is applied twice or lost."""

    def __init__(self, *, fold_at: int = FOLD_AT) -> None:
        self._pending: deque[tuple[Children[Any], tuple[str, ...], float]] = deque()
        self._fold_at = fold_at

    def add(self, children: Children[Any], values: tuple[str, ...], amount: float = 1.0) -> None:
        pending = self._pending
        pending.append((children, values, amount))
        if len(pending) >= self._fold_at:
            self.fold()

    def fold(self) -> None:
        """Apply every pending update."""
        pending = self._pending
        while pending:
            try:
                children, values, amount = pending.popleft()
            except IndexError:  # another thread took the last one
                return
            children.apply(values, amount)

    def describe(self) -> list[Any]:
        return []  # no family of its own: it only brings the others up to date

    def collect(self) -> Iterator[Any]:
        self.fold()
        return iter(())
