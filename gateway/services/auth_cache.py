"""What one replica knows about tenant keys, and the only database reads of authentication.

Entries are keyed by the SHA-256 of the whole token; the clock is passed in.

- A *verified* key is trusted until ``min(now + ttl, key expiry)``; then it is verified again.
  A key revoked through this replica's admin API stops working at once (any admin change clears
  the cache), through another replica or the CLI within ``ttl`` seconds.
- *Renewal*: every ``ttl / 2`` the keys used in the last two rounds (the last ``ttl``) are
  verified again in the background, all in one read (``renew``: by key id -- a key's secret was
  checked when it was first verified and never changes), each trusted anew until
  ``min(read start + ttl, expiry)``. A key used at least once every ``1.5 * ttl`` thus never
  waits for the database on the request path (renewed only in the round after a use, a key used
  every ``1.2 * ttl`` was looked up on the request path on about 2 uses in 5, every
  ``1.4 * ttl`` on 4 in 5), and a replica serving 10,000 tenants makes one read per renewal, not
  one per key and ``ttl``. A renewal
  that fails or runs late changes nothing: its entries expire as before and the request path
  verifies them.
- A *refused* token costs no database round trip again: unknown (no such key, or a wrong
  secret), revoked and expired for ``negative_ttl_s`` (default 600 s), a key of a disabled tenant
  for ``ttl`` (an enable through another replica applies within it, like a revocation).
- An *unknown prefix* costs no lookup of its own (``KnownPrefixes``): the replica keeps every
  key prefix the database holds (12 hex characters each) and, on a prefix it does not hold,
  reads only the keys stored since its last read -- one query, at most every
  ``PREFIX_REFRESH_S``, however many unknown keys arrive meanwhile.

Why nothing refused needs invalidating when a key is created, on this replica or any other: keys
are made by the gateway (``gateway.services.keys``: a 48-bit prefix and a 256-bit secret drawn at
creation), so no token anyone presented before can be a key created later, revocation and expiry
are final, and the first use of a new key on a replica that does not hold its prefix yet waits
for the read that brings it (at most ``PREFIX_REFRESH_S`` plus a round trip). So a new key works
at once on every replica, and a flood of unknown keys costs a few small reads per second.

Lookups (``verify``): one in flight per token -- a tenant's burst of 1,000 connections costs one
round trip, the others wait for it -- and at most ``lane_lookups`` in flight per *lane*: tokens
this replica verified before (renewals) and tokens it never did. Guessed secrets under a real
prefix (prefixes are not secret) thus hold at most ``lane_lookups`` of the database pool's
connections (15 by default) and never delay a tenant whose entry is being renewed; the wait for a
lane counts toward the request's ``database_timeout_s``. The per-address failure throttle
(``gateway.limits.auth_throttle``) bounds how many keys one address may get wrong.

Bounded: at most ``max_entries`` entries of each kind (full: that kind starts over); the prefix
set holds one entry per key ever issued (about 80 bytes each).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any, TypeVar

from contracts.sql import DatabaseTimeout
from gateway.domain import Principal
from gateway.services.keys import AuthFailure

MAX_ENTRIES = 100_000
NEGATIVE_TTL_S = 600.0
LANE_LOOKUPS = 4
PREFIX_REFRESH_S = 0.05
PREFIX_BATCH = 10_000  # keys per read: a large table is learnt in steps that each keep their gain
_FINAL = frozenset({AuthFailure.UNKNOWN, AuthFailure.REVOKED, AuthFailure.EXPIRED})

Verdict = Principal | AuthFailure
T = TypeVar("T")
# keys stored after an id, at most so many: (id, prefix)
Fetch = Callable[[int, int], Awaitable[list[tuple[int, str]]]]
# the verdicts on these key ids now (a key the database no longer has is left out)
Renew = Callable[[list[int]], Awaitable[dict[int, Verdict]]]


class AuthCache:
    def __init__(
        self,
        *,
        ttl_s: float,
        negative_ttl_s: float = NEGATIVE_TTL_S,
        max_entries: int = MAX_ENTRIES,
        lane_lookups: int = LANE_LOOKUPS,
    ) -> None:
        self._ttl = timedelta(seconds=ttl_s)
        self._negative_ttl = timedelta(seconds=negative_ttl_s)
        self._max = max_entries
        self._verified: dict[str, tuple[Principal, datetime]] = {}  # kept past expiry: "known"
        self._used: set[str] = set()  # verified entries used since the last renewal
        self._used_before: set[str] = set()  # ... in the round before it
        self._generation = 0  # moved by ``clear``: a renewal begun before it writes nothing
        self._refused: dict[str, tuple[AuthFailure, datetime]] = {}
        self._flights: dict[str, asyncio.Future[Verdict]] = {}
        self._known_lane = asyncio.Semaphore(lane_lookups)
        self._unknown_lane = asyncio.Semaphore(lane_lookups)
        self.prefixes = KnownPrefixes()
        self.lookups = 0  # database lookups started (tests and benchmarks read it)

    @staticmethod
    def _key(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    def get(self, token: str, *, now: datetime) -> Verdict | None:
        """What this replica knows about ``token`` now: the tenant, why it is refused, or None
        (the database must be asked)."""
        key = self._key(token)
        verified = self._verified.get(key)
        if verified is not None and now < verified[1]:
            self._used.add(key)
            return verified[0]
        refused = self._refused.get(key)
        if refused is not None and now < refused[1]:
            return refused[0]
        return None

    def verified_before(self, token: str) -> bool:
        """Whether this replica verified ``token`` before (its entry may have expired): its
        lookups go in the lane of such tokens (``verify``)."""
        return self._key(token) in self._verified

    def put(self, token: str, verdict: Verdict, *, now: datetime) -> None:
        self._put(self._key(token), verdict, now=now)

    def _put(self, key: str, verdict: Verdict, *, now: datetime) -> None:
        if isinstance(verdict, Principal):
            if not self._ttl:
                return
            until = now + self._ttl
            if verdict.key_expires_at is not None:
                until = min(until, verdict.key_expires_at)
            _bounded_put(self._verified, key, (verdict, until), self._max)
            self._refused.pop(key, None)
            return
        self._verified.pop(key, None)  # a refusal ends the trust at once (a renewal's too)
        ttl = self._negative_ttl if verdict in _FINAL else self._ttl
        if verdict is not AuthFailure.MALFORMED and ttl:
            _bounded_put(self._refused, key, (verdict, now + ttl), self._max)

    @property
    def renewal_interval_s(self) -> float | None:
        """How often ``renew`` runs (half the ttl), or None when verified keys are not kept."""
        ttl = self._ttl.total_seconds()
        return ttl / 2 if ttl else None

    async def renew(self, fetch: Renew, *, now: datetime) -> list[Principal]:
        """Verify again, in one ``fetch``, every key used in this round or the one before
        (``now``: taken before the read starts, so a renewed entry is trusted at most ``ttl``
        past a moment before the database answered). A key the database no longer holds is
        refused as unknown; a revoked, expired or disabled one as the request path would.
        Returns the principals renewed (their keys were in use: the caller stamps last use)."""
        used = self._used | self._used_before
        self._used_before, self._used = self._used, set()
        entries = {key: self._verified[key][0] for key in used if key in self._verified}
        if not entries:
            return []
        generation = self._generation
        verdicts = await fetch(sorted({p.key_id for p in entries.values()}))
        if generation != self._generation:
            return []  # an admin change cleared the cache meanwhile: nothing read before it counts
        renewed: list[Principal] = []
        for key, principal in entries.items():
            if self._verified.get(key, (None,))[0] is not principal:
                continue  # verified again (or dropped) meanwhile: that answer is newer
            verdict = verdicts.get(principal.key_id, AuthFailure.UNKNOWN)
            self._put(key, verdict, now=now)
            if isinstance(verdict, Principal):
                renewed.append(verdict)
        return renewed

    async def verify(
        self,
        token: str,
        *,
        now: datetime,
        lookup: Callable[[], Awaitable[Verdict]],
        timeout_s: float,
    ) -> Verdict:
        """Ask the database (``lookup``) about ``token``, once for every caller in flight, within a
        lane; the answer is cached. Raises ``DatabaseTimeout`` past ``timeout_s``."""
        key = self._key(token)
        flight = self._flights.get(key)
        if flight is None:
            known = self.get(token, now=now)  # a flight may have landed since the caller looked
            if known is not None:
                return known
            lane = self._known_lane if key in self._verified else self._unknown_lane
            flight = asyncio.ensure_future(self._fly(token, lane, lookup, now, timeout_s))
            self._flights[key] = flight
            flight.add_done_callback(lambda done: self._landed(key, done))
        return await asyncio.shield(flight)

    async def _fly(
        self,
        token: str,
        lane: asyncio.Semaphore,
        lookup: Callable[[], Awaitable[Verdict]],
        now: datetime,
        timeout_s: float,
    ) -> Verdict:
        try:
            async with asyncio.timeout(timeout_s), lane:
                self.lookups += 1
                verdict = await lookup()
        except TimeoutError as exc:
            raise DatabaseTimeout(f"the database did not answer within {timeout_s:.1f} s") from exc
        key = self._key(token)
        self._put(key, verdict, now=now)
        if key in self._verified:
            self._used.add(key)  # verified for a request: in use, renewed in the next round
        return verdict

    def _landed(self, key: str, flight: asyncio.Future[Verdict]) -> None:
        self._flights.pop(key, None)
        _retrieved(flight)

    def clear(self) -> None:
        self._verified.clear()
        self._refused.clear()
        self._used.clear()
        self._used_before.clear()
        self._generation += 1


def _bounded_put(entries: dict[str, T], key: str, value: T, max_entries: int) -> None:
    if len(entries) >= max_entries and key not in entries:
        entries.clear()  # bounded memory; the next requests simply ask again
    entries[key] = value


class KnownPrefixes:
    """Every key prefix the database holds, as this replica last read it (see the module
    docstring): ``holds`` answers at once for a prefix it has, and otherwise after a read of the
    keys stored since the last one -- a read that began after the question, shared by every
    question meanwhile, at most one per ``min_interval_s``."""

    def __init__(self, *, min_interval_s: float = PREFIX_REFRESH_S) -> None:
        self._min_interval = min_interval_s
        self._prefixes: set[str] = set()
        self._last_id = 0
        self._read: asyncio.Future[None] | None = None
        self._read_started = float("-inf")
        self.reads = 0  # database reads started (tests read it)

    def __len__(self) -> int:
        return len(self._prefixes)

    async def holds(self, prefix: str, *, fetch: Fetch, timeout_s: float) -> bool:
        if prefix in self._prefixes:
            return True
        asked = time.monotonic()
        try:
            async with asyncio.timeout(timeout_s):
                await self._read_since(asked, fetch)
        except TimeoutError as exc:
            raise DatabaseTimeout(f"the database did not answer within {timeout_s:.1f} s") from exc
        return prefix in self._prefixes

    async def _read_since(self, asked: float, fetch: Fetch) -> None:
        """Return once a read that started at or after ``asked`` has completed."""
        while True:
            read = self._read
            if read is not None and not read.done():
                started = self._read_started
                await asyncio.shield(read)
                if started >= asked:
                    return
                continue  # it began before the question: the next one answers it
            wait = self._min_interval - (time.monotonic() - self._read_started)
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            self._read_started = time.monotonic()
            self._read = asyncio.ensure_future(self._fetch(fetch))
            self._read.add_done_callback(_retrieved)

    async def _fetch(self, fetch: Fetch) -> None:
        while True:
            self.reads += 1
            rows = await fetch(self._last_id, PREFIX_BATCH)
            for key_id, prefix in rows:
                self._prefixes.add(prefix)
                self._last_id = max(self._last_id, key_id)
            if len(rows) < PREFIX_BATCH:
                return


def _retrieved(done: asyncio.Future[Any]) -> None:
    if not done.cancelled():
        done.exception()  # retrieved: every waiter may have gone away
