"""When suspected findings, together, are evidence enough to quarantine an engine. Pure.

A suspected finding is a damaged copy of another tenant's marker: no MAC proves it. One alone
does not quarantine (``canary_quarantine_on_suspected`` aside). Several do, under this rule:

    an engine is quarantined when, within ``window_s``, it produced *counting* suspected
    findings for at least ``tenants`` different requesting tenants.

A finding *counts* (``canary.runtime`` decides, this module only counts) when its damaged copy
shows the victim's nonce (23 or more body characters) and the marker's issue record names the
victim tenant and a request this same engine served, and the copy is nowhere in the requester's
own input in a form ``canary.evidence`` detects (not a replay).

Why a colluding group of tenants cannot aim it: the nonce is 64 random bits written only into
the victim's own request and never delivered to anyone (the firewall strips the owner's marker
and cuts every other), so a copy that shows it, with an issue record of a request this engine
served, is the engine's doing; a tenant who sends a marker in makes a replay, which never counts.
Tenants rather than findings are counted so that one requester's stream of findings is not
enough on its own. An incident's stale-page leak shows the victim's marker to whoever's request
reads the stale pages next, so it reaches several tenants within minutes.

Per replica, in memory (at most ``MAX_ENTRIES`` per engine): replicas behind a balancer each see
part of the findings, so corroboration may take longer with more replicas.
"""

from __future__ import annotations

from collections import deque

MAX_ENTRIES = 1000


class Corroboration:
    """Counting suspected findings per engine within a sliding window."""

    def __init__(self, *, window_s: float, tenants: int) -> None:
        if window_s <= 0 or tenants < 1:
            raise ValueError("window_s must be positive and tenants at least 1")
        self._window = window_s
        self._tenants = tenants
        self._seen: dict[str, deque[tuple[float, str]]] = {}

    def add(self, engine: str, tenant: str, *, now: float) -> int:
        """Count one finding on ``engine`` for requesting ``tenant`` at ``now``; return how many
        different tenants the engine's counting findings within the window came from."""
        seen = self._seen.setdefault(engine, deque(maxlen=MAX_ENTRIES))
        while seen and now - seen[0][0] > self._window:
            seen.popleft()
        seen.append((now, tenant))
        return len({who for _, who in seen})

    def reached(self, tenants: int) -> bool:
        return tenants >= self._tenants

    def forget(self, engine: str) -> None:
        """Start over for ``engine`` (it was quarantined)."""
        self._seen.pop(engine, None)
