"""The documented bounds. Each named bound is a few small instances, each covering every ordering.

- ``incident``: tenant A's request fits; tenant B's is over-long for prefill's real pool but fits
  decode's (the incident's configuration: window 8 > prefill pool 4). One client abort, one
  result timeout, one stale capacity view (decode admits B against its own pool only, so
  prefill's admission is exercised as the second line), one prefill crash.
- ``reuse``: two requests that both fit but not together, so the second reuses the first's pages
  (late writes, quarantine, zeroing); one client abort, one timeout.
- ``mixed``: prefill speaks the previous protocol version, decode the current one.
- ``adversary``: ``reuse`` with a peer of the transfer port that writes once into any memory
  registered at any moment (its write landing whenever it likes) and a result timeout;
  ``large-adversary`` adds a client abort.
- ``open_channel(bound)``: the same instance on the open channel (decode's pages registered,
  no seal): what the model shows with the new defences off.
- ``large``: ``large-incident`` adds a third request to ``incident`` (without the crash);
  ``large-reuse`` gives ``reuse`` two client aborts, a prefill crash and a decode crash.
- ``prefix`` and ``preempt`` (``large-preempt`` has two client aborts): the engine model, shared
  and preempted pages in one unified engine (``engine_world``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType

from backend.disagg.protocol import PROTOCOL_VERSION, KvChannel
from backend.verify.engine_world import EngineBound, EngineRequestSpec
from backend.verify.world import Bound, RequestSpec

_A, _B, _C = RequestSpec("A", 2), RequestSpec("B", 3), RequestSpec("C", 2)

INCIDENT = Bound(
    "incident",
    (_A, _B),
    decode_pages=5,
    prefill_pages=4,
    context_window=8,
    max_batch_pages=1,
    client_aborts=1,
    timeouts=1,
    prefill_crashes=1,
    stale_capacity_views=1,
)
# The incident alone (no aborts, timeouts or crashes): enough to show which check stops it.
INCIDENT_CORE = replace(
    INCIDENT, name="incident-core", client_aborts=0, timeouts=0, prefill_crashes=0
)
REUSE = Bound(
    "reuse",
    (_A, _C),
    decode_pages=5,
    prefill_pages=4,
    context_window=8,
    max_batch_pages=1,
    client_aborts=1,
    timeouts=1,
)
MIXED = Bound(
    "mixed",
    (_A, _C),
    decode_pages=5,
    prefill_pages=4,
    context_window=8,
    max_batch_pages=1,
    client_aborts=1,
    timeouts=1,
    prefill_version=PROTOCOL_VERSION - 1,
)
ADVERSARY = replace(REUSE, name="adversary", client_aborts=0, adversary_writes=1)
LARGE_ADVERSARY = replace(ADVERSARY, name="large-adversary", client_aborts=1)
LARGE_INCIDENT = Bound(
    "large-incident",
    (_A, _B, RequestSpec("D", 1)),
    decode_pages=6,
    prefill_pages=4,
    context_window=8,
    max_batch_pages=1,
    client_aborts=1,
    timeouts=1,
    stale_capacity_views=1,
)
LARGE_REUSE = Bound(
    "large-reuse",
    (_A, _C),
    decode_pages=5,
    prefill_pages=4,
    context_window=8,
    max_batch_pages=1,
    client_aborts=2,
    timeouts=1,
    prefill_crashes=1,
    decode_crashes=1,
)

# The engine model (pages of 2 tokens). ``prefix``: three requests with byte-identical prompts,
# tenants a and g in one operator group and b alone, arriving in any order, two client aborts.
# ``preempt``: two requests of tenant a whose prompts share a page and one of tenant b, that fit the
# 5-page pool alone but not together (preemption, recompute from the cache), one client abort.
PREFIX = EngineBound(
    "prefix",
    (
        EngineRequestSpec("a", (1, 2, 3), 3),
        EngineRequestSpec("b", (1, 2, 3), 2),
        EngineRequestSpec("g", (1, 2, 3, 1), 2),
    ),
    pages=8,
    page_size=2,
    max_running=3,
    max_batch_tokens=4,
    groups=(("team", ("a", "g")),),
    client_aborts=2,
)
PREEMPT = EngineBound(
    "preempt",
    (
        EngineRequestSpec("a", (1, 2, 3), 4),
        EngineRequestSpec("a", (1, 2, 1), 4),
        EngineRequestSpec("b", (2,), 3),
    ),
    pages=5,
    page_size=2,
    max_running=3,
    max_batch_tokens=4,
    client_aborts=1,
)
LARGE_PREEMPT = replace(PREEMPT, name="large-preempt", client_aborts=2)

BOUNDS: Mapping[str, tuple[Bound | EngineBound, ...]] = MappingProxyType(
    {
        "small": (INCIDENT, REUSE, MIXED, ADVERSARY, PREFIX, PREEMPT),
        "large": (LARGE_INCIDENT, LARGE_REUSE, MIXED, LARGE_ADVERSARY, PREFIX, LARGE_PREEMPT),
    }
)


def open_channel(bound: Bound) -> Bound:
    """``bound`` on the open channel: the sealed channel's defences (no registered pool, the
    per-handoff slots, the seal) all off."""
    return replace(bound, name=f"{bound.name}-open", channel=KvChannel.OPEN)


def named(name: str) -> Bound | EngineBound:
    """A small bound by name; ``<name>-open`` is that handoff bound on the open channel."""
    by_name = {bound.name: bound for bound in BOUNDS["small"]}
    base, _, suffix = name.rpartition("-open")
    bound = by_name.get(base if suffix == "" and base else name)
    if bound is None:
        raise KeyError(f"no small bound {name!r}")
    if name.endswith("-open"):
        assert isinstance(bound, Bound), "only handoff bounds have a channel"
        return open_channel(bound)
    return bound
