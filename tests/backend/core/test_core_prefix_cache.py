"""The tenant-scoped prefix cache through the scheduler: who shares which page (asserted on the
pool), read-only and verified reads, release and zeroing by the last holder, eviction order,
preemption, operator groups, the drill, and what the scope guarantees about timing."""

from __future__ import annotations

import random

import pytest

from backend.core.admission import CapacityLimits
from backend.core.errors import IsolationError, IsolationReason
from backend.core.pages import PagePool, PageState
from backend.core.prefix_cache import CacheScopes
from backend.core.request import TERMINAL, Request, RequestState, SamplingParams
from backend.core.scheduler import Scheduler

S = RequestState
KEY = b"k" * 32
SYSTEM = tuple(range(1, 13))  # a 12-token "system prompt": three pages of 4


def make(
    pages: int = 32,
    *,
    zero: bool = False,
    scopes: CacheScopes | None = None,
    running: int = 8,
) -> Scheduler:
    pool = PagePool(pages, 4, zero_on_free=zero)
    return Scheduler(
        pool,
        CapacityLimits.from_pool(pool, pages * 4),
        max_batch_tokens=64,
        max_running=running,
        watermark=0,
        cache_scopes=scopes or CacheScopes(KEY),
    )


def req(rid: str, tenant: str, prompt: tuple[int, ...], max_tokens: int = 3) -> Request:
    return Request(rid, tenant, prompt, SamplingParams(max_tokens))


def model(tokens: tuple[int, ...]) -> int:
    return (sum((i + 1) * t for i, t in enumerate(tokens)) % 97) + 1


def step(sched: Scheduler) -> list[tuple[str, int, int]]:
    """One engine step (the runner played by ``model``); returns the prefill chunks' spans."""
    out = sched.schedule()
    sched.pool.confirm_zeroed(out.pages_to_zero)
    size = sched.pool.page_size
    for d in out.decodes:
        sched.pool.verify(d.page_table, d.request.owner, writes_from=d.position // size)
    for c in out.prefills:
        sched.pool.verify(c.page_table, c.request.owner, writes_from=c.start // size)
    sampled: dict[str, int | None] = {
        d.request.request_id: model(d.request.token_ids(0, d.position + 1)) for d in out.decodes
    }
    for c in out.prefills:
        sampled[c.request.request_id] = model(c.request.token_ids(0, c.end)) if c.samples else None
    sched.postprocess(out, sampled)
    sched.check_invariants()
    return [(c.request.request_id, c.start, c.end) for c in out.prefills]


def drain(sched: Scheduler) -> list[list[tuple[str, int, int]]]:
    steps = []
    while sched.has_work():
        steps.append(step(sched))
        assert len(steps) < 500
    return steps


def pages_of(request: Request) -> set[int]:
    return {ref.page_id for ref in request.page_table}


def test_two_tenants_with_byte_identical_prompts_never_share_a_page() -> None:
    sched = make()
    a, b = req("a", "tenant-a", SYSTEM + (50, 51)), req("b", "tenant-b", SYSTEM + (50, 51))
    sched.add(a)
    step(sched)  # a prefilled: its three full pages are now cached, in a's scope
    sched.add(b)
    assert step(sched) == [("b", 0, 14)]  # b computes everything: no hit
    assert pages_of(a).isdisjoint(pages_of(b))
    for ref in a.page_table[:3]:
        page = sched.pool.page(ref.page_id)
        assert (page.state, page.readers) == (PageState.SHARED, frozenset({a.owner}))
    for ref in b.page_table[:3]:
        page = sched.pool.page(ref.page_id)
        assert (page.state, page.readers) == (PageState.SHARED, frozenset({b.owner}))
        assert page.scope != sched.pool.page(a.page_table[0].page_id).scope
    drain(sched)
    assert a.output_ids == b.output_ids  # same tokens, same answer, computed twice


def test_same_tenant_requests_share_the_prompts_full_pages() -> None:
    sched = make()
    first, second = req("a1", "tenant-a", SYSTEM + (50, 51)), req("a2", "tenant-a", SYSTEM + (60,))
    sched.add(first)
    step(sched)
    sched.add(second)
    assert step(sched) == [("a2", 12, 13)]  # three pages read from the cache, one token computed
    assert second.page_table[:3] == first.page_table[:3]
    for ref in second.page_table[:3]:
        page = sched.pool.page(ref.page_id)
        assert page.readers == frozenset({first.owner, second.owner})
    assert sched.kv.cache is not None and sched.kv.cache.stats.hit_tokens == 12
    drain(sched)
    assert second.output_ids == _alone("x", SYSTEM + (60,))


def test_a_hit_never_covers_the_last_token() -> None:
    sched = make()
    sched.add(req("a1", "t", SYSTEM))
    drain(sched)
    again = req("a2", "t", SYSTEM)  # all three pages cached; the last token must be computed
    sched.add(again)
    assert step(sched) == [("a2", 8, 12)]  # pages 0, 1 hit; page 2 recomputed into a new page
    # whose key a1's page 2 already has in the index: the duplicate stays a2's own
    assert sched.pool.state(again.page_table[2].page_id) is PageState.OWNED
    drain(sched)
    assert again.output_ids == _alone("x", SYSTEM)


def test_multi_turn_chat_reuses_the_previous_answer() -> None:
    sched = make()
    turn1 = req("t1", "tenant-a", SYSTEM + (70,), max_tokens=8)
    sched.add(turn1)
    drain(sched)
    history = SYSTEM + (70,) + tuple(turn1.output_ids)  # 21 tokens, 20 computed: 5 full pages
    turn2 = req("t2", "tenant-a", history + (80, 81, 82))
    sched.add(turn2)
    assert step(sched) == [("t2", 20, 24)]  # the prompt and the answer's first 7 tokens hit
    drain(sched)
    assert turn2.output_ids == _alone("x", history + (80, 81, 82))


def test_a_shared_page_is_read_only_and_read_by_its_readers_only() -> None:
    sched = make()
    a1, a2 = req("a1", "t", SYSTEM + (1,)), req("a2", "t", SYSTEM + (2,))
    sched.add(a1)
    step(sched)
    sched.add(a2)
    step(sched)
    shared = a1.page_table[0]
    with pytest.raises(IsolationError) as caught:  # a step may not write a shared page
        sched.pool.verify(a1.page_table, a1.owner, writes_from=0)
    assert caught.value.reason == IsolationReason.READ_ONLY
    outsider = req("b", "other", SYSTEM)
    with pytest.raises(IsolationError) as caught:
        sched.pool.verify([shared], outsider.owner)
    assert caught.value.reason == IsolationReason.OWNER_MISMATCH
    with pytest.raises(IsolationError) as caught:  # the pool refuses another scope's reader
        sched.pool.acquire([shared], outsider.owner, CacheScopes(KEY).scope_for("other"))
    assert caught.value.reason == IsolationReason.SCOPE_MISMATCH


def test_released_and_zeroed_only_when_the_last_holder_lets_go_and_it_is_evicted() -> None:
    sched = make(pages=8, zero=True)
    a1, a2 = req("a1", "t", SYSTEM + (1,), 2), req("a2", "t", SYSTEM + (2,), 6)
    sched.add(a1)
    step(sched)
    sched.add(a2)
    while a1.state is not S.FINISHED:
        step(sched)
    cached = [ref.page_id for ref in a2.page_table[:3]]
    assert all(sched.pool.num_readers(p) == 1 for p in cached)  # a2 still reads them
    drain(sched)
    assert [sched.pool.state(p) for p in cached] == [PageState.SHARED] * 3  # idle, still cached
    # Pages are needed: the idle cached pages are evicted (deepest first), then zeroed.
    hungry = req("b", "u", tuple(range(100, 129)), 3)  # all 8 pages
    sched.add(hungry)
    out = sched.schedule()
    assert out.prefills == () and set(cached) < set(out.pages_to_zero)
    assert all(sched.pool.state(p) is PageState.PENDING_ZERO for p in cached)
    sched.pool.confirm_zeroed(out.pages_to_zero)
    sched.postprocess(out, {})
    drain(sched)
    assert hungry.state is S.FINISHED
    generations = {sched.pool.page(p).generation for p in cached}
    assert generations == {2}  # reallocated after zeroing: a new generation


def test_eviction_takes_a_requests_deepest_page_first() -> None:
    sched = make(pages=8)
    a = req("a", "t", SYSTEM + (1,), 1)
    sched.add(a)
    step(sched)  # a's pages 0-3; it finished at its first token; 0, 1, 2 stay cached, idle
    chain = [p for p in range(8) if sched.pool.state(p) is PageState.SHARED]
    assert chain == [0, 1, 2] and a.state is S.FINISHED
    assert sched.kv.cache is not None
    assert sched.kv.cache.evict(1) == [] and sched.pool.state(chain[2]) is PageState.FREE
    assert sched.pool.state(chain[0]) is PageState.SHARED
    again = req("a2", "t", SYSTEM + (5,))
    sched.add(again)
    assert step(sched) == [("a2", 8, 13)]  # pages 0, 1 still hit; page 2 was evicted


def test_preempted_reader_unshares_and_recomputes_from_the_cache() -> None:
    sched = make(pages=9)
    a, b = req("a", "t", SYSTEM + (1,), 16), req("b", "t", SYSTEM + (2,), 16)
    sched.add(a)
    step(sched)
    sched.add(b)
    for _ in range(40):
        if b.preemptions:
            break
        step(sched)
    assert b.state is S.PREEMPTED and b.page_table == ()
    assert all(sched.pool.num_readers(ref.page_id) == 1 for ref in a.page_table[:3])
    steps = drain(sched)
    recompute = [span for spans in steps for span in spans if span[0] == "b"]
    assert recompute[0][1] >= 12  # the re-admitted b read at least the system prompt from cache
    assert a.output_ids == _alone("x", SYSTEM + (1,), 16)
    assert b.output_ids == _alone("x", SYSTEM + (2,), 16)


def test_an_operator_group_shares_and_the_drill_shares_everyone() -> None:
    grouped = CacheScopes.from_groups(KEY, {"acme": ["acme-eu", "acme-us"]})
    assert grouped.scope_for("acme-eu") == grouped.scope_for("acme-us")
    assert grouped.scope_for("acme-eu") != grouped.scope_for("other")
    assert CacheScopes(KEY).scope_for("a") != CacheScopes(b"j" * 32).scope_for("a")
    with pytest.raises(ValueError):
        CacheScopes.from_groups(KEY, {"x": ["t"], "y": ["t"]})
    for scopes, a_tenant, b_tenant in (
        (grouped, "acme-eu", "acme-us"),
        (CacheScopes(KEY, per_tenant=False), "tenant-a", "tenant-b"),
    ):
        sched = make(scopes=scopes)
        a, b = req("a", a_tenant, SYSTEM + (1,)), req("b", b_tenant, SYSTEM + (2,))
        sched.add(a)
        step(sched)
        sched.add(b)
        assert step(sched) == [("b", 12, 13)]
        assert b.page_table[:3] == a.page_table[:3]


def _b_schedule(scopes: CacheScopes, a_prompt: tuple[int, ...]) -> list[tuple[int, int]]:
    """What the engine computes for tenant B, step by step, after tenant A sent ``a_prompt``."""
    sched = make(pages=12, scopes=scopes)
    sched.add(req("a", "tenant-a", a_prompt, 4))
    drain(sched)
    sched.add(req("b", "tenant-b", SYSTEM + (9, 9), 4))
    spans = []
    while sched.has_work():
        out = sched.schedule()
        spans.append(
            (sum(c.num_tokens for c in out.prefills), len(out.decodes))
            if out.prefills or out.decodes
            else (0, 0)
        )
        sched.pool.confirm_zeroed(out.pages_to_zero)
        sampled: dict[str, int | None] = {rid: 7 for rid in out.sampling_request_ids}
        sched.postprocess(out, sampled)
    return spans


def test_timing_b_cannot_learn_whether_another_tenant_sent_its_prefix() -> None:
    """Every step's work for B (tokens computed, decodes) is the same whether A sent B's prompt
    or other tokens of the same length: nothing B can time depends on A's content. The drill
    (one scope for all) is the control: then B's first step computes 2 tokens instead of 14."""
    same, other = SYSTEM + (9, 9), tuple(range(40, 54))
    salted = CacheScopes(KEY)
    assert _b_schedule(salted, same) == _b_schedule(salted, other)
    assert _b_schedule(salted, same)[0] == (14, 0)
    unsalted = CacheScopes(KEY, per_tenant=False)
    assert _b_schedule(unsalted, same)[0] == (2, 0)
    assert _b_schedule(unsalted, other)[0] == (14, 0)


@pytest.mark.parametrize("zero_on_free", [False, True])
def test_random_tenants_sharing_prefixes_keep_the_books_and_the_answers(
    zero_on_free: bool,
) -> None:
    rng = random.Random(3)
    sched = make(pages=14, zero=zero_on_free, running=5)
    systems = {t: tuple(rng.randrange(1, 90) for _ in range(9)) for t in ("a", "b", "c")}
    requests = []
    for i in range(60):
        tenant = rng.choice("abc")
        prompt = systems[tenant] + tuple(rng.randrange(1, 90) for _ in range(rng.randint(1, 8)))
        request = req(f"r{i}", tenant, prompt, rng.randint(1, 12))
        requests.append(request)
        sched.add(request)
        for _ in range(rng.randint(0, 3)):
            step(sched)
            _assert_scopes_match_tenants(sched, requests)
        if rng.random() < 0.1:
            sched.abort(rng.choice(requests).request_id)
    drain(sched)
    assert all(r.state in TERMINAL for r in requests)
    assert sched.kv.cache is not None and sched.kv.cache.stats.hit_tokens >= 200
    assert sched.num_preemptions >= 3
    for r in requests:
        if r.state is S.FINISHED:
            assert r.output_ids == _alone("x", r.prompt_ids, r.sampling.max_tokens), r
    assert sched.pool.free_pages + sched.pool.shared_pages == 14


def _assert_scopes_match_tenants(sched: Scheduler, requests: list[Request]) -> None:
    """On the pool: every page two live requests read is read by one tenant only."""
    for page_id in range(sched.pool.num_pages):
        tenants = {owner.tenant for owner in sched.pool.page(page_id).readers}
        assert len(tenants) <= 1, (page_id, tenants)


def _alone(rid: str, prompt: tuple[int, ...], max_tokens: int = 3) -> list[int]:
    sched = make(pages=64)
    request = req(rid, "solo", prompt, max_tokens)
    sched.add(request)
    drain(sched)
    return request.output_ids


def test_the_cache_can_be_off() -> None:
    pool = PagePool(9, 4, zero_on_free=False)
    sched = Scheduler(pool, CapacityLimits.from_pool(pool, 36), max_batch_tokens=64, max_running=4)
    a1, a2 = req("a1", "t", SYSTEM + (1,)), req("a2", "t", SYSTEM + (2,))
    sched.add(a1)
    step(sched)
    sched.add(a2)
    assert step(sched) == [("a2", 0, 13)] and pool.shared_pages == 0
    assert sched.kv.cache is None and pages_of(a1).isdisjoint(pages_of(a2))
