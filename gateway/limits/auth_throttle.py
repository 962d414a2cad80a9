"""Throttling repeated failed credentials per client address: operator tokens and tenant keys.

Per client address (``gateway.deps.client_address``: the real peer, or what a proxy the operator
lists forwarded), a leaky bucket of failures: each wrong credential adds one; the bucket drains
``capacity`` per ``window_s``. While it is full, every attempt from that address is refused with
429 before its credential is even compared or looked up, so a guesser gets ``capacity`` tries per
window and no answer about the rest; the address's legitimate operator waits out the same
``Retry-After``. Operator tokens (admin, metrics) and tenant keys fill separate buckets
(``Bucket``), each with its own capacity: a flood of unknown tenant keys neither locks an
operator out nor spends the database's time on lookups beyond its budget.

In process, per replica (each replica allows its own ``capacity`` per window); bounded to
``max_addresses`` buckets (the longest-idle dropped first).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from enum import StrEnum


class Bucket(StrEnum):
    OPERATOR = "operator"  # the admin and metrics tokens
    TENANT = "tenant"  # tenant API keys


class FailedCredentialThrottle:
    def __init__(
        self,
        *,
        capacity: int = 10,
        window_s: float = 60.0,
        max_addresses: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._capacity = capacity
        self._window = window_s
        self._max = max_addresses
        self._clock = clock
        # (bucket, address) -> (level, when)
        self._levels: OrderedDict[tuple[Bucket, str], tuple[float, float]] = OrderedDict()

    def retry_after_s(
        self, address: str, *, bucket: Bucket = Bucket.OPERATOR, capacity: int | None = None
    ) -> int | None:
        """Seconds until ``address`` may try again, or None when it may now."""
        limit = self._capacity if capacity is None else capacity
        level = self._level((bucket, address), self._clock(), limit)
        if level + 1 <= limit:
            return None
        return max(1, math.ceil((level + 1 - limit) / (limit / self._window)))

    def failed(
        self, address: str, *, bucket: Bucket = Bucket.OPERATOR, capacity: int | None = None
    ) -> None:
        limit = self._capacity if capacity is None else capacity
        now = self._clock()
        key = (bucket, address)
        level = self._level(key, now, limit)
        self._levels[key] = (min(limit, level + 1), now)
        self._levels.move_to_end(key)
        while len(self._levels) > self._max:
            self._levels.popitem(last=False)

    def _level(self, key: tuple[Bucket, str], now: float, limit: int) -> float:
        entry = self._levels.get(key)
        if entry is None:
            return 0.0
        level, at = entry
        return max(0.0, level - (now - at) * limit / self._window)
