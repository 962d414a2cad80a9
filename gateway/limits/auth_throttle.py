"""Throttling repeated failed operator credentials (the admin token, the metrics token).

Per client address, a leaky bucket of failures: each wrong credential adds one; the bucket drains
``capacity`` per ``window_s``. While it is full, every attempt from that address is refused with
429 before its credential is even compared, so a guesser gets ``capacity`` tries per window and
no answer about the rest; the address's legitimate operator waits out the same ``Retry-After``.

In process, per replica (each replica allows its own ``capacity`` per window); bounded to
``max_addresses`` (the longest-idle drop first). Behind a reverse proxy every client shares the
proxy's address unless the server is told to trust its forwarded headers; then the throttle
bounds the whole deployment's failure rate instead (see docs/security.md).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable


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
        self._rate = capacity / window_s  # failures drained per second
        self._max = max_addresses
        self._clock = clock
        self._levels: OrderedDict[str, tuple[float, float]] = OrderedDict()  # address -> (lvl, t)

    def retry_after_s(self, address: str) -> int | None:
        """Seconds until ``address`` may try again, or None when it may now."""
        level = self._level(address, self._clock())
        if level + 1 <= self._capacity:
            return None
        return max(1, math.ceil((level + 1 - self._capacity) / self._rate))

    def failed(self, address: str) -> None:
        now = self._clock()
        level = self._level(address, now)
        self._levels[address] = (min(self._capacity, level + 1), now)
        self._levels.move_to_end(address)
        while len(self._levels) > self._max:
            self._levels.popitem(last=False)

    def _level(self, address: str, now: float) -> float:
        entry = self._levels.get(address)
        if entry is None:
            return 0.0
        level, at = entry
        return max(0.0, level - (now - at) * self._rate)
