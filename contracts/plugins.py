"""Seams where other parts (the canary) plug into the request and response paths.

- ``RequestHook.prepare``: may rewrite the upstream body before tokens are counted (so an
  injected canary marker is counted and limited like any other prompt text; a request that fits
  only without what the hooks added is sent as the client wrote it), or refuse the request by
  raising ``RequestRefused`` (a 400 with its message and code).
- ``GuardFactory.open`` -> ``StreamGuard``: sees every piece of response text in order,
  streaming or not. ``feed`` returns the text to deliver now (it may hold some back: a marker
  could be completing across chunks) or a ``Cut``; ``finish`` releases what was held back, or
  cuts; ``redactions`` counts what it removed (for the answer to say that it was changed).
  After a ``Cut`` the gateway sends an OpenAI-style error (an SSE error event mid-stream, an
  error response otherwise), closes the upstream and calls ``on_cut``.
- ``on_cut``: told ids only (request, tenant, engine), never content.
- ``on_finish``: told, once per request at its single exit, the ids, counts and timings of a
  ``RequestReport`` (never content): the canary's lower-severity checks and per-request cleanup.
- ``services``: started once the lifespan has built the gateway, with the few parts of it a
  service may use (``ServiceContext``), and stopped before it is torn down (the canary's
  background work).
- ``routers``: extra API routers the app mounts (the canary's findings and probe-run API).

A guard factory states its ``capabilities`` (``GuardCapabilities``) instead of being probed: whether
its guards can find anything outside the text (the default pass-through cannot, so side fields are
not screened at all), and a cheap prefilter that clears an answer's side fields without walking
them.

A response can carry several choices: the relay opens one guard per choice (``GuardFactory.open``
is called once per choice and once for the event fields around the text), so a guard only ever
sees one text stream in order.

The default hooks pass everything through untouched, so streamed bytes reach the client exactly
as the engine sent them (but for what the gateway itself tells the tenant: its ``kvguard`` object
in a final chunk, in place of the engine's, and an engine's error events without addresses).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    from fastapi import APIRouter
    from prometheus_client import CollectorRegistry
    from sqlalchemy.orm import Session, sessionmaker


ENGINE_HEADER = "x-kvguard-engine"
"""Response header naming the engine that served a *synthetic* (canary probe) tenant's request."""


@dataclass(frozen=True, slots=True)
class RequestInfo:
    request_id: str
    tenant_id: str
    model: str
    endpoint: str
    synthetic: bool
    canary_sample_rate: float
    engine: str | None = None


@dataclass(frozen=True, slots=True)
class Emit:
    text: str = field(repr=False)


@dataclass(frozen=True, slots=True)
class Cut:
    code: str  # stable, e.g. "isolation_violation"
    message: str  # shown to the client: must name no content
    status: int = 502


class StreamGuard(Protocol):
    """One text stream's guard. ``feed`` and ``finish`` are required; a guard that subclasses
    this protocol inherits the defaults of the two optional capabilities the side-field screen
    uses (``gateway.proxy.side.SideScreen``), which a guard overrides to make screening cheap and
    cut-only fields safe."""

    __slots__ = ()

    def feed(self, text: str) -> Emit | Cut: ...

    def finish(self) -> Emit | Cut: ...

    def passes(self, text: str) -> bool:
        """``feed``'s usual case without its result: True when ``text`` was taken as fed and
        would be delivered unchanged with nothing reported (the caller sends it as it is);
        False when nothing happened and ``text`` must go to ``feed``. The relay asks this of
        every streamed text first (no ``Emit`` per event)."""
        return False

    def skippable(self, text: str) -> bool:
        """True when feeding ``text`` now could change nothing this guard reports or delivers."""
        return False

    def exposed(self) -> Cut | None:
        """Asked while the guard holds text back that goes out anyway: the Cut to end the stream
        first, or None when that is safe."""
        return None

    def carried(self) -> object:
        """What this guard carries from one text into the next besides what it holds (compared,
        never read: a value that changes while a streamed event is screened makes the next event
        with the same side fields screened again rather than taken as unchanged). A guard that
        skips texts (``skippable``) and reads each in the light of the ones before must say
        what it carries."""
        return None

    def passes_whole(self, text: str) -> bool:
        """Asked of a guard nothing was fed yet, for a whole text it would be fed and then
        finished on: True when that would deliver ``text`` unchanged and report nothing (the
        caller then feeds nothing; ``finish`` still answers)."""
        return False

    def passes_each_whole(self, texts: Sequence[str]) -> bool:
        """Asked of a guard nothing was fed yet: True when each of ``texts``, fed whole to a fresh
        guard like this one and finished, would pass (``passes_whole`` of each), answered in one
        check for a whole answer's side fields. False may only mean "ask each"."""
        return False

    def expose_whole(self, text: str) -> bool:
        """Asked of a guard that holds nothing, for the whole text a streamed event carries in a
        field that goes out as the engine sent it (its values joined): True when feeding it and
        then asking ``exposed`` would cut nothing and leave the guard holding nothing -- the
        guard is then in that state, and the caller feeds nothing."""
        return False

    def redactions(self) -> int:
        """How many pieces of text this guard removed from what it delivered so far (the leak
        firewall: marker-like candidates, each counting one whatever its kind, so the count tells
        a tenant nothing about which kind it was). An answer's count is the sum over its guards."""
        return 0


Prefilter = Callable[[str, dict[str, Any]], bool]  # (an event's JSON text, the event)


@dataclass(frozen=True, slots=True)
class GuardCapabilities:
    """What a guard factory's guards can do, stated once by the factory."""

    screens_side: bool = True  # False only when the guards pass everything: no side screening
    side_prefilter: Prefilter | None = None  # False: no side field can hold what the guards seek


class GuardFactory(Protocol):
    @property
    def capabilities(self) -> GuardCapabilities: ...

    def open(self, info: RequestInfo) -> StreamGuard: ...


class RequestRefused(Exception):
    """A request hook refuses the request: the client gets a 400 with this message and code (the
    message names no content)."""

    def __init__(self, message: str, *, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class RequestHook(Protocol):
    async def prepare(self, info: RequestInfo, body: dict[str, Any]) -> dict[str, Any]: ...


class PassThroughGuard(StreamGuard):
    def feed(self, text: str) -> Emit | Cut:
        return Emit(text)

    def passes(self, text: str) -> bool:
        return True

    def finish(self) -> Emit | Cut:
        return Emit("")


class PassThroughFactory:
    capabilities = GuardCapabilities(screens_side=False)

    def open(self, info: RequestInfo) -> StreamGuard:
        return PassThroughGuard()


@dataclass(frozen=True, slots=True)
class RequestReport:
    """How one request ended: ids, counts and timings only.

    ``prompt_tokens`` is the gateway's own count of what the engine read, hooks' additions
    included (exact for engines with a tokenizer endpoint, ``exact_count``; a safe upper bound
    otherwise); ``engine_prompt_tokens`` is what the engine
    reported in ``usage``. ``first_token_s`` is the time from forwarding to the first streamed
    text (streaming only).
    """

    info: RequestInfo
    outcome: str
    status: int
    stream: bool
    prompt_tokens: int | None
    engine_prompt_tokens: int | None
    completion_tokens: int | None
    exact_count: bool
    first_token_s: float | None


OnCut = Callable[[RequestInfo, Cut], Awaitable[None]]
OnFinish = Callable[[RequestReport], Awaitable[None]]


class Quarantine(Protocol):
    async def __call__(self, name: str, *, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class ServiceContext:
    """The parts of a running gateway a hook service may use."""

    metrics: CollectorRegistry  # the gateway's /metrics: a service registers its collectors here
    sessions: sessionmaker[Session]  # the gateway's database (``contracts.sql.run_in_session``)
    tenant_ids: Callable[[], Awaitable[list[str]]]  # every tenant's id, from the database
    redis_url: str | None  # the shared Redis, when the gateway runs with one
    quarantine: Quarantine  # take an engine out of routing now, on every replica
    spool_dir: Path  # where records wait for the database (``contracts.spool``)
    database_timeout_s: float  # the bound of any one database operation
    # a background task the gateway watches: one that ends by itself is a health problem
    watch: Callable[[asyncio.Task[None]], None]


class HookService(Protocol):
    async def start(self, context: ServiceContext) -> None: ...

    async def stop(self) -> None: ...


@dataclass(slots=True)
class GatewayHooks:
    request_hooks: list[RequestHook] = field(default_factory=list)
    guards: GuardFactory = field(default_factory=PassThroughFactory)
    on_cut: OnCut | None = None
    on_finish: OnFinish | None = None
    services: list[HookService] = field(default_factory=list)
    routers: list[APIRouter] = field(default_factory=list)
