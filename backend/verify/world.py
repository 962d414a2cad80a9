"""The model checker's world: one reachable state of decode, prefill and everything between them.

What is the code's own (imported, never copied): the decode page pool (a real ``PagePool``), the
request lifecycle (``RequestState`` / ``TRANSITIONS``), both handoff tables (driven through
``Machine.advance``, with the ``FaultSet``'s decode table), the message classes and their wire
codec (every message crosses ``to_wire`` / ``*_from_wire`` with the receiver's protocol version),
admission (``admit``), decode's checks (``verify_result``), the refusal mapping (``refusal``) and
prefill's transfer-loop decisions (``may_start_batch`` / ``lease_cut_short`` / ``transfer_end``).

What is modelled here, because it lies outside the code: page memory (what bytes each decode page
holds, and whether a write landed after its page's generation changed), decode's landing slots
(one per page: what sealed chunk each holds) and which of them are registered with the transport,
the transport's in-flight one-sided writes (a set that lands in any order, interleaved with
control messages), the control channel (an unordered set of messages: delay and reordering are
free), clients that abort or time out, role crashes, prefill's lease clock, a peer on another
protocol version, and an adversary on the transfer port: it writes into any registered memory at
any moment, its writes land whenever it likes (even after the memory was withdrawn, as a TCP
write validated before that would), and it forges the checksum (crc32 is no MAC) but not a seal
without the handoff's key. On the open channel decode's pages themselves are registered.

A ``World`` is mutable while one action builds its successor; ``key`` is its canonical, hashable
fingerprint (two worlds with equal keys have the same future).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from enum import StrEnum

from backend.core.admission import CapacityLimits
from backend.core.pages import Owner, PagePool, PageRef, PageState
from backend.core.request import TERMINAL, RequestState
from backend.disagg.faults import FaultSet
from backend.disagg.machines import DecodeHandoffState, PrefillHandoffState
from backend.disagg.protocol import (
    PROTOCOL_VERSION,
    AbortAck,
    AbortRequest,
    KvChannel,
    KvLayout,
    PageGrant,
    PrefillRequest,
    PrefillResult,
    TransferTarget,
)

MAX_TOKENS = 2  # the first output token comes from prefill, the second step reads the KV


@dataclass(frozen=True, slots=True)
class RequestSpec:
    tenant: str
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Bound:
    """The finite instance explored: requests, pools and how many faults the environment has.

    Page size is one token, so a prompt of n tokens is n pages plus one for the output token.
    """

    name: str
    requests: tuple[RequestSpec, ...]
    decode_pages: int
    prefill_pages: int  # prefill's real pool (the incident: smaller than the window)
    context_window: int  # advertised by both roles
    max_batch_pages: int
    client_aborts: int
    timeouts: int
    prefill_crashes: int = 0
    decode_crashes: int = 0
    stale_capacity_views: int = 0  # admissions that see only decode's own pool
    prefill_version: int = PROTOCOL_VERSION
    zero_on_free: bool = True  # the deployment's setting (a fault may turn it off)
    crash_kills_writes: bool = True  # TCP transport: a dead writer's writes never land
    channel: KvChannel = KvChannel.SEALED
    adversary_writes: int = 0  # writes a peer of the transfer port makes

    @property
    def decode_limits(self) -> CapacityLimits:
        return CapacityLimits(1, self.decode_pages, self.context_window)

    @property
    def prefill_limits(self) -> CapacityLimits:
        return CapacityLimits(1, self.prefill_pages, self.context_window)

    @property
    def cross_role_limits(self) -> CapacityLimits:
        """What decode admits against: min(own pool, prefill's pool), as the prefill client does."""
        return CapacityLimits(1, min(self.decode_pages, self.prefill_pages), self.context_window)


ADVERSARY = "adversary"  # the writer of bytes a peer of the transfer port wrote
WRONG_KEY = " (opened without its key)"  # what an unauthenticated open makes of another's chunk


# What a decode page (or landing slot) physically holds: zeros, or request ``request_index``'s KV
# at ``position`` (in a slot: sealed under ``writer``'s key for that position and generation).
# ``late`` marks a write that landed after its page's generation changed (property 4);
# ``writer`` names the handoff that wrote it, or ``ADVERSARY``. Only (index, position) are the
# bytes a checksum sees: the adversary forges them.
@dataclass(frozen=True, slots=True)
class Cell:
    request_index: int | None  # None: zeros
    position: int = 0
    writer: str = ""
    generation: int = 0
    late: bool = False

    @property
    def content(self) -> tuple[int, int] | None:
        return None if self.request_index is None else (self.request_index, self.position)


ZERO_CELL = Cell(None)


@dataclass(frozen=True, slots=True)
class Write:
    """One committed one-sided write of one page: it lands whatever happened to the page."""

    instance: int
    handoff_id: str
    request_index: int
    position: int
    page: PageGrant


@dataclass(frozen=True, slots=True)
class ChannelError:
    """Decode's call to prefill ended without a readable result (peer lost, wrong version)."""

    handoff_id: str
    instance: int
    kind: str  # "lost" | "protocol_mismatch"


Wire = PrefillRequest | PrefillResult | AbortRequest | AbortAck | ChannelError


class Cause(StrEnum):
    """Why a request ended: what property 5 may excuse (the client or the network ended it)."""

    ADMISSION = "admission"
    PREFILL_REPLY = "prefill_reply"
    CLIENT_ABORT = "client_abort"
    LOST = "lost"
    DECODE_CRASH = "decode_crash"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class DecodeRequest:
    """Decode's books for one client request (None state: not submitted yet)."""

    state: RequestState | None = None
    handoff: DecodeHandoffState | None = None
    handoff_id: str = ""
    instance: int = 0
    refs: tuple[PageRef, ...] = ()
    draining: tuple[PageRef, ...] = ()
    error_code: str | None = None
    cause: Cause | None = None
    read: bool = False  # the first decode step has read the prompt's KV


@dataclass(frozen=True, slots=True)
class PrefillHandoff:
    """Prefill's books for one PrefillRequest (lost when prefill crashes)."""

    request: PrefillRequest
    request_index: int
    state: PrefillHandoffState
    tokens: int  # how many prompt tokens prefill computes (1 with the legacy placeholder)
    placeholder: bool
    written: int = 0
    batch: tuple[Write, ...] = ()  # the committed batch not yet returned by the transport
    cancelled: bool = False
    lease_over: bool = False
    abort_waiting: bool = False  # an AbortRequest waits for quiescence before its ack


@dataclass(slots=True)
class Events:
    """What the last action did, for the invariants that judge transitions, not states."""

    accepted: list[int] = field(default_factory=list)
    read: list[tuple[int, tuple[Cell, ...]]] = field(default_factory=list)
    committed: list[Write] = field(default_factory=list)
    ended: list[int] = field(default_factory=list)


@dataclass(slots=True)
class World:
    bound: Bound
    faults: FaultSet
    pool: PagePool
    owners: tuple[Owner, ...]
    memory: list[Cell]
    requests: list[DecodeRequest]
    kv_waiting: tuple[int, ...] = ()
    handoffs: dict[str, PrefillHandoff] = field(default_factory=dict)
    tombstones: frozenset[tuple[int, str]] = frozenset()
    wire: frozenset[Wire] = frozenset()
    writes: frozenset[Write] = frozenset()
    instance: int = 1
    prefill_epoch: int = 1
    sequence: int = 0
    # aborts, timeouts, crashes P/D, stale views, adversary writes
    budget: tuple[int, int, int, int, int, int] = (0, 0, 0, 0, 0, 0)
    truth: dict[str, PrefillHandoffState] = field(default_factory=dict)  # prefill's last word
    landing: list[Cell] = field(default_factory=list)  # the sealed channel's slots, one per page
    registered: frozenset[int] = frozenset()  # landing slots registered with the transport
    adversary: frozenset[int] = frozenset()  # slots (open: pages) an adversary write is bound for
    events: Events = field(default_factory=Events)
    pool_shared: bool = False  # copy-on-write: a clone shares its parent's pool until it moves it

    @classmethod
    def initial(cls, bound: Bound, faults: FaultSet) -> World:
        owners = tuple(Owner(f"r{i}", spec.tenant) for i, spec in enumerate(bound.requests))
        return cls(
            bound,
            faults,
            _new_pool(bound, faults),
            owners,
            [ZERO_CELL] * bound.decode_pages,
            [DecodeRequest() for _ in bound.requests],
            budget=(
                bound.client_aborts,
                bound.timeouts,
                bound.prefill_crashes,
                bound.decode_crashes,
                bound.stale_capacity_views,
                bound.adversary_writes,
            ),
            landing=[ZERO_CELL] * bound.decode_pages,
        )

    def clone(self) -> World:
        return World(
            self.bound,
            self.faults,
            self.pool,
            self.owners,
            list(self.memory),
            list(self.requests),
            self.kv_waiting,
            dict(self.handoffs),
            self.tombstones,
            self.wire,
            self.writes,
            self.instance,
            self.prefill_epoch,
            self.sequence,
            self.budget,
            dict(self.truth),
            landing=list(self.landing),
            registered=self.registered,
            adversary=self.adversary,
            pool_shared=True,
        )

    def writable_pool(self) -> PagePool:
        """The pool, copied first if still shared with the parent world (every page move)."""
        if self.pool_shared:
            memo: dict[int, object] = {id(owner): owner for owner in self.owners}
            self.pool = copy.deepcopy(self.pool, memo)
            self.pool_shared = False
        return self.pool

    def key(self) -> tuple[object, ...]:
        pool = self.pool
        pages = tuple(
            (s.state, s.generation, s.owner.request_id if s.owner else None)
            for s in (pool.page(i) for i in range(pool.num_pages))
        )
        return (
            pages,
            pool.free_queue(),
            tuple(self.memory),
            tuple(self.requests),
            self.kv_waiting,
            tuple(sorted(self.handoffs.items())),
            self.tombstones,
            self.wire,
            self.writes,
            self.instance,
            self.prefill_epoch,
            self.sequence,
            self.budget,
            tuple(sorted(self.truth.items())),
            tuple(self.landing),
            self.registered,
            self.adversary,
        )

    # -- small helpers the actions share ---------------------------------------------------------

    @property
    def sealed(self) -> bool:
        return self.bound.channel is KvChannel.SEALED

    def target(self) -> TransferTarget:
        layout = KvLayout(1, self.bound.decode_pages, 1, 1, 1, "float32")
        bases = (4096,) if self.sealed else (4096, 8192)
        return TransferTarget(
            "decode",
            f"d{self.instance}",
            self.bound.channel,
            bases,
            layout,
            self.bound.max_batch_pages,
        )

    def set_request(self, index: int, **changes: object) -> None:
        self.requests[index] = replace(self.requests[index], **changes)  # type: ignore[arg-type]

    def index_of_handoff(self, handoff_id: str, instance: int) -> int | None:
        for index, request in enumerate(self.requests):
            if request.handoff_id == handoff_id and request.instance == instance:
                return index
        return None

    def send(self, message: Wire) -> None:
        self.wire = self.wire | {message}

    def done(self) -> bool:
        """Every request terminal, nothing in flight, every page back in the free list."""
        pool = self.pool
        return (
            all(r.state in TERMINAL for r in self.requests)
            and not self.wire
            and not self.writes
            and not self.handoffs
            and not self.registered
            and not self.adversary
            and pool.free_pages == pool.num_pages
        )


def _new_pool(bound: Bound, faults: FaultSet) -> PagePool:
    return PagePool(bound.decode_pages, 1, zero_on_free=faults.zero_on_free(bound.zero_on_free))


def new_pool(bound: Bound, faults: FaultSet) -> PagePool:
    """A decode incarnation's fresh pool (the zero setting as the role builds it)."""
    return _new_pool(bound, faults)


def held_state(pool: PagePool, page_id: int) -> PageState:
    return pool.page(page_id).state
