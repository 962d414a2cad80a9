"""The tenant-scoped prefix cache: full KV pages a later request of the same namespace reuses.

Keys. A request's page ``i`` is keyed by a hash chain over its tokens::

    k_0 = SHA-256("kvguard-prefix-v1:" + scope)        k_i = SHA-256(k_(i-1) + tokens of page i)

so one key names a page's tokens, every token before them, and the scope. The scope is
``CacheScopes.scope_for(tenant)``: HMAC-SHA256 of the tenant id under a key the engine draws at
start-up, or of a group name when an operator's setting (``prefix_cache_groups``) puts tenants in
one group. No request field reaches it: the tenant comes from the ``X-Kvguard-Tenant`` header the
gateway sets, and a client cannot name, guess or share another tenant's scope.

Lifecycle of a cached page (its states are ``PagePool``'s; this class keeps the index)::

    OWNED by r ──publish (full, computed, key not indexed)──▶ SHARED {scope, readers: r}
    SHARED ──acquire by a later request of the same scope (a hit)──▶ one more reader
    SHARED ──unshare (a reader ends or is preempted)──▶ no reader left: idle (LRU)
    idle ──acquire──▶ read again          idle ──evict (pages needed)──▶ FREE | PENDING_ZERO

- ``publish`` runs after every step: a page becomes SHARED once every slot of it holds computed
  K/V, so nothing writes it again (the pool refuses a step that would: ``READ_ONLY``). A page whose
  key is already indexed (two requests computed the same prefix at once) stays its owner's.
- ``lookup`` follows a request's keys from page 0 and stops at the first miss; hits never cover
  the request's last token (its logits must be computed). ``acquire`` makes the request a reader
  through ``PagePool.acquire``, which refuses a page of another scope, so a bug in the index
  cannot hand one tenant's page to another; reads are then verified by (page, generation, reader)
  like any other.
- ``evict`` releases idle pages, least recently used first (a request's deepest page first, so a
  chain is evicted from its end), through the pool's one release path: zeroed before reuse, the
  next allocation bumps the generation.

What the scope guarantees about timing. Two requests share a page only if their keys are equal, and
equal keys need equal scopes: with per-tenant scopes (the default) no request of tenant B can hit a
page computed for tenant A, whatever their tokens. Which of B's pages hit is a function of B's own
requests and of evictions; evictions depend on how much others hold and when (their token counts
and timing, and so their tokens only through their own scope's hits: a tenant whose requests repeat
a prefix holds fewer pages), never on whether another tenant sent a prefix B sends: no page of
another scope is in B's chains. So B's time to first token cannot tell B whether another tenant
sent B's prefix; it tells B no more about other tenants than a cacheless engine's load does
(``test_core_prefix_cache``: B's schedule is identical whether A sent B's prompt or other tokens of
the same length). Tenants an operator puts in one group share a scope: each of them can learn from
timing whether another member recently sent a prefix (the CVE-2025-46570 channel) — the price of
sharing their cache hits, for tenants that trust each other (one customer's tenant ids). The
``shared_prefix_across_tenants`` fault drill puts every tenant in one scope: the unsalted cache,
whose counterexample the model checker prints.

Pure bookkeeping (``hashlib``/``hmac``/``struct`` compute keys; no I/O, no environment).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from backend.core.pages import PagePool, PageRef, PageState
from backend.core.request import Request

_ROOT = b"kvguard-prefix-v1:"
_EVERY_TENANT = "drill:every-tenant"


@dataclass(frozen=True, slots=True)
class CacheScopes:
    """Which prefix-cache namespace a tenant's requests use.

    ``key``: the engine's secret (drawn at start-up). ``groups``: tenant -> group name, from the
    operator's setting only. ``per_tenant`` is False only in the ``shared_prefix_across_tenants``
    drill (one scope for everyone).
    """

    key: bytes = field(repr=False)
    groups: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    per_tenant: bool = True

    def __deepcopy__(self, memo: dict[int, object]) -> CacheScopes:
        return self  # immutable (a copied engine, in the model checker, keeps its scopes)

    def __post_init__(self) -> None:
        if len(self.key) < 16:
            raise ValueError("the prefix-cache scope key needs at least 16 bytes")

    @classmethod
    def from_groups(
        cls, key: bytes, groups: Mapping[str, Iterable[str]], *, per_tenant: bool = True
    ) -> CacheScopes:
        """``groups``: group name -> its tenants (each tenant in at most one group)."""
        by_tenant: dict[str, str] = {}
        for name, tenants in groups.items():
            for tenant in tenants:
                if tenant in by_tenant:
                    raise ValueError(f"tenant {tenant!r} is in two prefix-cache groups")
                by_tenant[tenant] = name
        return cls(key, MappingProxyType(by_tenant), per_tenant)

    def scope_for(self, tenant: str) -> str:
        if not self.per_tenant:
            label = _EVERY_TENANT
        elif tenant in self.groups:
            label = "group:" + self.groups[tenant]
        else:
            label = "tenant:" + tenant
        return hmac.new(self.key, label.encode("utf-8"), hashlib.sha256).hexdigest()[:32]


@dataclass(slots=True)
class CacheStats:
    query_tokens: int = 0  # tokens of admitted requests that a hit could have covered
    hit_tokens: int = 0  # of those, tokens read from cached pages instead of computed


class PrefixCache:
    def __init__(self, pool: PagePool, scopes: CacheScopes) -> None:
        self._pool = pool
        self._scopes = scopes
        self._index: dict[bytes, PageRef] = {}
        self._key_of: dict[int, bytes] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()  # SHARED, no reader; LRU first
        self.stats = CacheStats()

    @property
    def cached_pages(self) -> int:
        return len(self._key_of)

    @property
    def idle_pages(self) -> int:
        """Cached pages no request reads: evictable."""
        return len(self._idle)

    def scope(self, request: Request) -> str:
        if request.cache_scope is None:
            request.cache_scope = self._scopes.scope_for(request.tenant)
        return request.cache_scope

    # -- admission ---------------------------------------------------------------------------

    def lookup(self, request: Request) -> list[PageRef]:
        """The cached pages that hold the start of the request's tokens, in order (no change)."""
        size = self._pool.page_size
        hits: list[PageRef] = []
        for index in range((request.num_tokens - 1) // size):
            ref = self._index.get(self._key(request, index))
            if ref is None:
                break
            hits.append(ref)
        return hits

    def acquire(self, request: Request, hits: Sequence[PageRef]) -> None:
        """The request reads ``hits`` (from ``lookup``) as the head of its page table."""
        self._pool.acquire(hits, request.owner, self.scope(request))
        for ref in hits:
            self._idle.pop(ref.page_id, None)
        size = self._pool.page_size
        self.stats.query_tokens += (request.num_tokens - 1) // size * size
        self.stats.hit_tokens += len(hits) * size

    # -- after a step ------------------------------------------------------------------------

    def publish(self, request: Request) -> None:
        """Index the request's pages that became full of computed K/V since the last call."""
        full = request.num_computed_tokens // self._pool.page_size
        for index in range(request.cached_upto, full):
            key = self._key(request, index)
            ref = request.page_table[index]
            if key in self._index or self._pool.state(ref.page_id) is not PageState.OWNED:
                continue
            self._pool.share([ref], request.owner, self.scope(request))
            self._index[key] = ref
            self._key_of[ref.page_id] = key
        request.cached_upto = max(request.cached_upto, full)

    def release(self, request: Request, refs: Sequence[PageRef]) -> None:
        """The request stops reading these SHARED pages; unread ones become idle, the deepest
        first in eviction order."""
        idle = self._pool.unshare(refs, request.owner)
        for page_id in reversed(idle):
            self._idle[page_id] = None

    def evict(self, n: int, *, keep: Iterable[PageRef] = ()) -> list[int]:
        """Forget up to ``n`` idle pages (LRU), except ``keep``; returns the ids to zero."""
        kept = {ref.page_id for ref in keep}
        chosen = [page_id for page_id in self._idle if page_id not in kept][: max(0, n)]
        for page_id in chosen:
            del self._idle[page_id]
            del self._index[self._key_of.pop(page_id)]
        return self._pool.evict(chosen)

    # -- keys and books ----------------------------------------------------------------------

    def _key(self, request: Request, index: int) -> bytes:
        keys, size = request.page_keys, self._pool.page_size
        while len(keys) <= index:
            previous = (
                keys[-1] if keys else hashlib.sha256(_ROOT + self.scope(request).encode()).digest()
            )
            start = len(keys) * size
            tokens = request.token_ids(start, start + size)
            keys.append(hashlib.sha256(previous + struct.pack(f"<{size}I", *tokens)).digest())
        return keys[index]

    def fingerprint(self) -> tuple[object, ...]:
        """The index (which page holds which key) and the eviction order, hashable."""
        return tuple(sorted(self._key_of.items())), tuple(self._idle)

    def check_invariants(self) -> list[str]:
        """What is wrong with the index: every indexed page SHARED at its indexed generation,
        every SHARED page indexed, idle exactly the unread ones."""
        problems: list[str] = []
        pool = self._pool
        if {ref.page_id for ref in self._index.values()} != set(self._key_of):
            problems.append("prefix cache: index and page keys disagree")
        for key, ref in self._index.items():
            page = pool.page(ref.page_id)
            if page.state is not PageState.SHARED or page.generation != ref.generation:
                problems.append(f"prefix cache: page {ref.page_id} indexed but {page.state}")
            if self._key_of.get(ref.page_id) != key:
                problems.append(f"prefix cache: page {ref.page_id} under two keys")
        if pool.shared_pages != len(self._key_of):
            problems.append(f"{pool.shared_pages} shared pages, {len(self._key_of)} indexed")
        unread = {p for p in self._key_of if pool.num_readers(p) == 0}
        if unread != set(self._idle):
            problems.append(f"prefix cache: idle {sorted(self._idle)} != unread {sorted(unread)}")
        return problems
