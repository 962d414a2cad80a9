"""A short-lived, per-replica cache of verified keys (the hot path's only database read).

Lifecycle of an entry: a key verified against the database -> cached under the SHA-256 of the
whole token until ``min(now + ttl, key expiry)`` -> dropped on expiry, or at once when this
replica's admin API changes any key or tenant (``clear``). Failures are never cached, so a new
key works immediately; a key revoked through another replica (or the CLI) stops working here
within ``ttl`` seconds. Pure: the clock is passed in.
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta

from gateway.domain import Principal

MAX_ENTRIES = 100_000


class AuthCache:
    def __init__(self, *, ttl_s: float) -> None:
        self._ttl = timedelta(seconds=ttl_s)
        self._entries: dict[str, tuple[Principal, datetime]] = {}

    @staticmethod
    def _key(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    def get(self, token: str, *, now: datetime) -> Principal | None:
        if not self._ttl:
            return None
        entry = self._entries.get(self._key(token))
        if entry is None:
            return None
        principal, until = entry
        if now >= until:
            self._entries.pop(self._key(token), None)
            return None
        return principal

    def put(self, token: str, principal: Principal, *, now: datetime) -> None:
        if not self._ttl:
            return
        if len(self._entries) >= MAX_ENTRIES:
            self._entries.clear()  # bounded memory; the next requests simply re-verify
        until = now + self._ttl
        if principal.key_expires_at is not None:
            until = min(until, principal.key_expires_at)
        self._entries[self._key(token)] = (principal, until)

    def clear(self) -> None:
        self._entries.clear()
